/* RMSNorm, SwiGLU (and GeGLU) and rope of a training step on CPU, forward and backward, in f32 or bf16, one pass
 * each, and the online softmax of the loss over a vocabulary's slabs (SOFTMAX_SLAB).
 *
 * Written in torch ops, SwiGLU's forward is a silu and a multiply and its backward four passes over
 * (tokens, n_ff) tensors; RMSNorm's forward five passes and its backward eight; rope on bf16 widens to
 * f32, rotates and rounds back, three passes. Each pass reads and writes whole activations, and torch's
 * silu spends most of its time on its exp. Here each function
 * reads its inputs once and writes its outputs once, in 16-wide vectors (vec.h), computing in f32:
 * bf16 operands are widened on load, results rounded once on store (torch rounds the intermediate
 * silu(gate) to bf16 too; these do not).
 *
 * Every element is computed by one thread and every row's sum in a fixed order, so the results do not
 * depend on the number of threads. Built and loaded by ggtorch/ops/fused.py (ggtorch/ops/clib.py).
 */
#include "vec.h"
#include "fused.h"

#define CHUNK 2048 /* elements per task of the elementwise loops: a multiple of L */
#define MIN_PARALLEL 16384 /* below this many elements a call runs on the caller's thread */

/* The elements [i, i + m) (m <= L) of a vector: whole vectors straight from memory, a tail through a
 * zeroed buffer, so the tail runs the same vector code as the rest. */
#define LOAD_PART(T, LD, dst, src, i, m)                                                                    \
    do {                                                                                                    \
        if ((m) == L) dst = LD((src) + (i));                                                                \
        else {                                                                                              \
            T buf_[L] = {0};                                                                                \
            memcpy(buf_, (src) + (i), (m) * sizeof(T));                                                     \
            dst = LD(buf_);                                                                                 \
        }                                                                                                   \
    } while (0)

#define STORE_PART(T, ST, dst, i, m, v)                                                                     \
    do {                                                                                                    \
        if ((m) == L) ST((dst) + (i), v);                                                                   \
        else {                                                                                              \
            T buf_[L];                                                                                      \
            ST(buf_, v);                                                                                    \
            memcpy((dst) + (i), buf_, (m) * sizeof(T));                                                     \
        }                                                                                                   \
    } while (0)

/* BODY for every vector [i, i + m) of n elements (m = L but at the end), CHUNK elements a task of the team. */
#define FOR_VECTORS(n, threads, ...)                                                                        \
    const int64_t chunks = ((n) + CHUNK - 1) / CHUNK;                                                       \
    const int nt = team(threads, n, MIN_PARALLEL, chunks);                                                  \
    (void)nt;                                                                                               \
    PARALLEL_FOR                                                                                            \
    for (int64_t c = 0; c < chunks; ++c) {                                                                  \
        const int64_t end = (c + 1) * CHUNK < (n) ? (c + 1) * CHUNK : (n);                                  \
        for (int64_t i = c * CHUNK; i < end; i += L) {                                                      \
            const int64_t m = end - i < L ? end - i : L;                                                    \
            __VA_ARGS__                                                                                     \
        }                                                                                                   \
    }

/* act(g) = g * sigmoid(z(g)): silu z = g; GELU's tanh approximation 0.5 g (1 + tanh(u)) = g sigmoid(2u) with
 * u = sqrt(2/pi) (g + 0.044715 g^3), the formula ggml writes (ggml_gelu_f32) and torch's gelu(approximate="tanh")
 * computes; `gelu` is a constant of each caller below, so its branches fold away. */
#define GELU_2C 1.5957691216057308f /* 2 sqrt(2/pi) */
static inline v16 act_arg(v16 g, int gelu) { return gelu ? GELU_2C * (g + 0.044715f * (g * g * g)) : g; }

static inline v16 act_slope(v16 g, int gelu) { /* dz/dg */
    return gelu ? GELU_2C * (1.f + 0.134145f * (g * g)) : splat(1.f);
}

#define KERNELS(T, SUFFIX, LD, ST)                                                                          \
    /* out = act(g) * u = g / (1 + e^-z) * u */                                                             \
    static inline __attribute__((always_inline)) void glu_##SUFFIX(const T *g, const T *u, T *out,          \
                                                                   int64_t n, int gelu, int threads) {      \
        FOR_VECTORS(n, threads, {                                                                           \
            v16 gv, uv;                                                                                     \
            LOAD_PART(T, LD, gv, g, i, m);                                                                  \
            LOAD_PART(T, LD, uv, u, i, m);                                                                  \
            STORE_PART(T, ST, out, i, m, gv / (1.f + vexp(-act_arg(gv, gelu))) * uv);                       \
        })                                                                                                  \
    }                                                                                                       \
                                                                                                            \
    /* with s = sigmoid(z): grad_g = grad * u * s * (1 + g * (1 - s) * dz/dg) (silu's derivative as torch's  \
       silu_backward writes it; GELU's the same), grad_u = grad * g * s; either output may be NULL */       \
    static inline __attribute__((always_inline)) void glu_backward_##SUFFIX(                                \
        const T *g, const T *u, const T *grad, T *grad_g, T *grad_u, int64_t n, int gelu, int threads) {    \
        FOR_VECTORS(n, threads, {                                                                           \
            v16 gv, uv, dv;                                                                                 \
            LOAD_PART(T, LD, gv, g, i, m);                                                                  \
            LOAD_PART(T, LD, uv, u, i, m);                                                                  \
            LOAD_PART(T, LD, dv, grad, i, m);                                                               \
            const v16 s = 1.f / (1.f + vexp(-act_arg(gv, gelu)));                                           \
            if (grad_g) STORE_PART(T, ST, grad_g, i, m, dv * uv * (s * (1.f + gv * (1.f - s) * act_slope(gv, gelu)))); \
            if (grad_u) STORE_PART(T, ST, grad_u, i, m, dv * (gv * s));                                     \
        })                                                                                                  \
    }                                                                                                       \
                                                                                                            \
    /* sum of a[k] * b[k] * c[k] (c NULL: of a[k] * b[k]) over one row, b f32 when it is the weight */      \
    static float row_sum_##SUFFIX(const T *a, const T *b, const float *w, int64_t C) {                      \
        v16 acc = {0};                                                                                      \
        for (int64_t k = 0; k < C; k += L) {                                                                \
            const int64_t m = C - k < L ? C - k : L;                                                        \
            v16 av, bv, wv = splat(1.f);                                                                    \
            LOAD_PART(T, LD, av, a, k, m);                                                                  \
            LOAD_PART(T, LD, bv, b, k, m);                                                                  \
            if (w) LOAD_PART(float, ld_f32, wv, w, k, m);                                                   \
            acc += av * bv * wv;                                                                            \
        }                                                                                                   \
        float t = 0.f;                                                                                      \
        for (int l = 0; l < L; ++l) t += acc[l];                                                            \
        return t;                                                                                           \
    }                                                                                                       \
                                                                                                            \
    /* per row: rstd = 1 / sqrt(mean(x^2) + eps), out = x * rstd * w */                                     \
    static void rms_norm_##SUFFIX(const T *x, const float *w, T *out, float *rstd, int64_t rows, int64_t C, \
                                  float eps, int threads) {                                                 \
        const int nt = team(threads, rows * C, MIN_PARALLEL, rows);                                         \
        (void)nt;                                                                                           \
        PARALLEL_FOR                                                                                        \
        for (int64_t i = 0; i < rows; ++i) {                                                                \
            const T *xi = x + i * C;                                                                        \
            const float r = 1.f / __builtin_sqrtf(row_sum_##SUFFIX(xi, xi, NULL, C) / (float)C + eps);      \
            rstd[i] = r;                                                                                    \
            for (int64_t k = 0; k < C; k += L) {                                                            \
                const int64_t m = C - k < L ? C - k : L;                                                    \
                v16 xv, wv;                                                                                 \
                LOAD_PART(T, LD, xv, xi, k, m);                                                             \
                LOAD_PART(float, ld_f32, wv, w, k, m);                                                      \
                STORE_PART(T, ST, out + i * C, k, m, xv * r * wv);                                          \
            }                                                                                               \
        }                                                                                                   \
    }                                                                                                       \
                                                                                                            \
    /* per row, with gw = grad * w: grad_x = gw * rstd - x * mean(gw * x) * rstd^3 */                       \
    static void rms_norm_backward_##SUFFIX(const T *x, const float *w, const float *rstd, const T *grad,    \
                                           T *grad_x, int64_t rows, int64_t C, int threads) {               \
        const int nt = team(threads, rows * C, MIN_PARALLEL, rows);                                         \
        (void)nt;                                                                                           \
        PARALLEL_FOR                                                                                        \
        for (int64_t i = 0; i < rows; ++i) {                                                                \
            const T *xi = x + i * C, *gi = grad + i * C;                                                    \
            const float r = rstd[i];                                                                        \
            const float coef = row_sum_##SUFFIX(gi, xi, w, C) / (float)C * (r * r * r);                     \
            for (int64_t k = 0; k < C; k += L) {                                                            \
                const int64_t m = C - k < L ? C - k : L;                                                    \
                v16 xv, gv, wv;                                                                             \
                LOAD_PART(T, LD, xv, xi, k, m);                                                             \
                LOAD_PART(T, LD, gv, gi, k, m);                                                             \
                LOAD_PART(float, ld_f32, wv, w, k, m);                                                      \
                STORE_PART(T, ST, grad_x + i * C, k, m, gv * wv * r - xv * coef);                           \
            }                                                                                               \
        }                                                                                                   \
    }

KERNELS(float, f32, ld_f32, st_f32)
KERNELS(uint16_t, bf16, ld_bf16, st_bf16)

static const i32x16 LANES = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

/* One slab of the loss's online softmax (ggtorch/training/loss.py): for each of `rows` rows of `width` logits
 * (row stride ld), the target's logit is added to picked[i] when the slab holds it (targets[i] - v0 in
 * [0, width)), then every logit l is overwritten by e = e^(l - m), summed into run_sum[i]. The row's reference
 * m stays run_max[i] while the slab's largest logit is at most `headroom` above it (so e <= e^headroom);
 * otherwise (and on the first slab, run_max -inf) it becomes that logit, and the sums so far are rescaled:
 * rescale[i] = e^(old m - new m) (1 when m stays), run_sum[i] times it here, the caller's sums of e times it.
 * Exact rows maxima would rescale on most slabs; the result is the same up to rounding. */
#define SOFTMAX_SLAB(T, SUFFIX, LD, ST, GET)                                                                \
    static void softmax_slab_##SUFFIX(T *x, int64_t rows, int64_t width, int64_t ld, const int64_t *targets, \
                                      int64_t v0, float *run_max, float *run_sum, float *picked,            \
                                      float *rescale, float headroom, int threads) {                        \
        const int nt = team(threads, rows * width, MIN_PARALLEL, rows);                                     \
        (void)nt;                                                                                           \
        PARALLEL_FOR                                                                                        \
        for (int64_t i = 0; i < rows; ++i) {                                                                \
            T *xi = x + i * ld;                                                                             \
            v16 top = splat(-__builtin_inff());                                                             \
            for (int64_t k = 0; k < width; k += L) {                                                        \
                const int64_t m = width - k < L ? width - k : L;                                            \
                v16 v;                                                                                      \
                LOAD_PART(T, LD, v, xi, k, m);                                                              \
                if (m < L) v = vselect(LANES < (int)m, v, splat(-__builtin_inff()));                        \
                top = vselect((i32x16)(v > top), v, top);                                                   \
            }                                                                                               \
            float slab_max = top[0];                                                                        \
            for (int l = 1; l < L; ++l) slab_max = top[l] > slab_max ? top[l] : slab_max;                   \
            const int64_t t = targets[i] - v0;                                                              \
            if (t >= 0 && t < width) picked[i] += GET(xi + t);                                              \
            float ref = run_max[i], r = 1.f;                                                                \
            if (ref == -__builtin_inff()) ref = slab_max;                                                   \
            else if (slab_max > ref + headroom) {                                                           \
                r = vexp_or_0(splat(ref - slab_max))[0];                                                    \
                ref = slab_max;                                                                             \
            }                                                                                               \
            v16 sum = {0};                                                                                  \
            for (int64_t k = 0; k < width; k += L) {                                                        \
                const int64_t m = width - k < L ? width - k : L;                                            \
                v16 v;                                                                                      \
                LOAD_PART(T, LD, v, xi, k, m);                                                              \
                v16 e = vexp_or_0(v - ref);                                                                 \
                if (m < L) e = vselect(LANES < (int)m, e, splat(0.f));                                      \
                sum += e;                                                                                   \
                STORE_PART(T, ST, xi, k, m, e);                                                             \
            }                                                                                               \
            float s = 0.f;                                                                                  \
            for (int l = 0; l < L; ++l) s += sum[l];                                                        \
            run_sum[i] = run_sum[i] * r + s;                                                                \
            run_max[i] = ref;                                                                               \
            rescale[i] = r;                                                                                 \
        }                                                                                                   \
    }

SOFTMAX_SLAB(float, f32, ld_f32, st_f32, f32_of_f32)
SOFTMAX_SLAB(uint16_t, bf16, ld_bf16, st_bf16, f32_of_bf16)

/* Rope rotates pairs of one head's values: (x[i], x[i + half]) with `halves` (ggml's NEOX mode), else
 * (x[2i], x[2i + 1]) (NORM), by the row's angle i: (x0 c - x1 s, x0 s + x1 c) in f32, each product and
 * the sum rounded, as ggml's loop and torch's ops round them (no FMA: NO_CONTRACT below). NORM's
 * pairs sit side by side in a vector: out = x * (c0 c0 c1 c1 ..) + (x1 x0 x3 x2 ..) * (-s0 s0 -s1 s1 ..),
 * lane shuffles that need __builtin_shufflevector: without it (GCC before 12) there is no rope here and
 * fused.py keeps torch's (ggtorch_rope_built). */
#define ROPE_MAX_D 1024 /* widest head (fused.py's ROPE_MAX_D) */

#ifdef GGTORCH_SHUFFLES
#define ROPE_HEAD(T, LD, ST)                                                                                \
    if (halves) {                                                                                           \
        for (int64_t i = 0; i < half; i += L) {                                                             \
            const int64_t m = half - i < L ? half - i : L;                                                  \
            v16 x0, x1, cv, sv;                                                                             \
            LOAD_PART(T, LD, x0, xh, i, m);                                                                 \
            LOAD_PART(T, LD, x1, xh + half, i, m);                                                          \
            LOAD_PART(float, ld_f32, cv, c, i, m);                                                          \
            LOAD_PART(float, ld_f32, sv, s, i, m);                                                          \
            sv *= sign;                                                                                     \
            STORE_PART(T, ST, oh, i, m, x0 * cv - x1 * sv);                                                 \
            STORE_PART(T, ST, oh + half, i, m, x0 * sv + x1 * cv);                                          \
        }                                                                                                   \
    } else { /* c2, s2: the row's angles, each twice, the sines signed (-s0 s0 -s1 s1 ..) */                \
        for (int64_t k = 0; k < 2 * half; k += L) {                                                         \
            const int64_t m = 2 * half - k < L ? 2 * half - k : L;                                          \
            v16 xv, cv, sv;                                                                                 \
            LOAD_PART(T, LD, xv, xh, k, m);                                                                 \
            LOAD_PART(float, ld_f32, cv, c2, k, m);                                                         \
            LOAD_PART(float, ld_f32, sv, s2, k, m);                                                         \
            const v16 sw = __builtin_shufflevector(xv, xv, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14); \
            STORE_PART(T, ST, oh, k, m, xv * cv + sw * sv);                                                 \
        }                                                                                                   \
    }

/* Products and sums not fused into FMAs (which round once) in a function marked so; with Clang, in every
 * function from here on (the pragma's scope), so the rope functions come last. */
#if defined(__clang__)
#define NO_CONTRACT
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#define NO_CONTRACT __attribute__((optimize("fp-contract=off")))
#else
#define NO_CONTRACT
#endif

#define ROPE(T, SUFFIX, LD, ST)                                                                             \
    NO_CONTRACT static void rope_##SUFFIX(const T *x, const float *cos, const float *sin, T *out,           \
                                          int64_t rows, int64_t T_, int64_t H, int64_t half, int halves,    \
                                          int per_row, float sign, int threads) {                           \
        const int nt = team(threads, rows * H * 2 * half, MIN_PARALLEL, rows);                              \
        (void)nt;                                                                                           \
        PARALLEL_FOR                                                                                        \
        for (int64_t row = 0; row < rows; ++row) { /* row = b * T + t */                                    \
            const float *c = cos + (per_row ? row : row % T_) * half;                                       \
            const float *s = sin + (per_row ? row : row % T_) * half;                                       \
            float c2[ROPE_MAX_D], s2[ROPE_MAX_D];                                                           \
            if (!halves)                                                                                    \
                for (int64_t i = 0; i < half; ++i) {                                                        \
                    c2[2 * i] = c2[2 * i + 1] = c[i];                                                       \
                    s2[2 * i] = -(s2[2 * i + 1] = sign * s[i]);                                             \
                }                                                                                           \
            for (int64_t h = 0; h < H; ++h) {                                                               \
                const T *xh = x + (row * H + h) * 2 * half;                                                 \
                T *oh = out + (row * H + h) * 2 * half;                                                     \
                ROPE_HEAD(T, LD, ST)                                                                        \
            }                                                                                               \
        }                                                                                                   \
    }

ROPE(float, f32, ld_f32, st_f32)
ROPE(uint16_t, bf16, ld_bf16, st_bf16)
#endif

void ggtorch_glu(const void *g, const void *u, void *out, int64_t n, int gelu, int bf16, int threads) {
    if (bf16) gelu ? glu_bf16(g, u, out, n, 1, threads) : glu_bf16(g, u, out, n, 0, threads);
    else gelu ? glu_f32(g, u, out, n, 1, threads) : glu_f32(g, u, out, n, 0, threads);
}

void ggtorch_glu_backward(const void *g, const void *u, const void *grad, void *grad_g, void *grad_u, int64_t n,
                          int gelu, int bf16, int threads) {
    if (bf16) gelu ? glu_backward_bf16(g, u, grad, grad_g, grad_u, n, 1, threads)
                   : glu_backward_bf16(g, u, grad, grad_g, grad_u, n, 0, threads);
    else gelu ? glu_backward_f32(g, u, grad, grad_g, grad_u, n, 1, threads)
              : glu_backward_f32(g, u, grad, grad_g, grad_u, n, 0, threads);
}

void ggtorch_rms_norm(const void *x, const float *w, void *out, float *rstd, int64_t rows, int64_t C, float eps,
                      int bf16, int threads) {
    if (bf16) rms_norm_bf16(x, w, out, rstd, rows, C, eps, threads);
    else rms_norm_f32(x, w, out, rstd, rows, C, eps, threads);
}

void ggtorch_rms_norm_backward(const void *x, const float *w, const float *rstd, const void *grad, void *grad_x,
                               int64_t rows, int64_t C, int bf16, int threads) {
    if (bf16) rms_norm_backward_bf16(x, w, rstd, grad, grad_x, rows, C, threads);
    else rms_norm_backward_f32(x, w, rstd, grad, grad_x, rows, C, threads);
}

int64_t ggtorch_softmax_slab(void *x, int64_t rows, int64_t width, int64_t ld, const int64_t *targets, int64_t v0,
                             float *run_max, float *run_sum, float *picked, float *rescale, float headroom, int bf16,
                             int threads) {
    if (bf16) softmax_slab_bf16(x, rows, width, ld, targets, v0, run_max, run_sum, picked, rescale, headroom, threads);
    else softmax_slab_f32(x, rows, width, ld, targets, v0, run_max, run_sum, picked, rescale, headroom, threads);
    int64_t moved = 0;
    for (int64_t i = 0; i < rows; ++i) moved += rescale[i] != 1.f;
    return moved;
}

int ggtorch_rope(const void *x, const float *cos, const float *sin, void *out, int64_t rows, int64_t T, int64_t H,
                 int64_t half, int halves, int per_row, float sign, int bf16, int threads) {
#ifdef GGTORCH_SHUFFLES
    if (2 * half > ROPE_MAX_D) return -1;
    if (bf16) rope_bf16(x, cos, sin, out, rows, T, H, half, halves, per_row, sign, threads);
    else rope_f32(x, cos, sin, out, rows, T, H, half, halves, per_row, sign, threads);
    return 0;
#else
    (void)x, (void)cos, (void)sin, (void)out, (void)rows, (void)T, (void)H, (void)half, (void)halves, (void)per_row;
    (void)sign, (void)bf16, (void)threads;
    return -1;
#endif
}

int ggtorch_rope_built(void) {
#ifdef GGTORCH_SHUFFLES
    return 1;
#else
    return 0;
#endif
}
