/* Causal or masked self-attention of a training step on CPU, forward and backward: f32, and bf16 where the
 * compiler targets the CPU's bf16 dot products (the bf16 section below).
 *
 * Written in torch ops (models/attention.py's products path), attention is batched products with passes
 * between them: the scores are written out, then scaled and masked, softmaxed, and in backward combined
 * with their gradient, a pass over them each, and the products want their operands in (batch·head, tokens,
 * head) layout, a copy of q, k, v and of the gradients each way. Here a task takes one query head of one
 * sequence, copies the query rows it reads (and their output gradients) a tile or block at a time,
 * transposes the keys (and values) once, reads the other rows where they are, and runs every product as
 * 8-row tiles of register-blocked multiply-adds (tile), each tile of queries against only the keys it may
 * see, so a causal mask costs the diagonal tiles' upper halves and no more; a tile's softmax runs on its
 * scores while they are in cache. Forward keeps each row's log-sum-exp; backward computes the scores and
 * probabilities again from it, as flash attention does, so nothing of size tokens² outlives a task.
 *
 * q, out and grad_q are (B, H, T, D), k, v and their gradients (B, Hkv, T, D), each given by its strides in
 * elements (sequence, head, token) with D contiguous; query head h reads key and value head h / (H / Hkv).
 * `allowed` (NULL for causal) is a (B or 1, T, T) byte mask, nonzero where query i may see key j, its
 * sequence stride 0 when every sequence shares it. A row that may see no key gets probabilities 0 (output 0),
 * as torch's scaled_dot_product_attention gives it. Every output element is computed by one thread in a fixed
 * order, so results do not depend on the number of threads. Built and loaded by ggtorch/ops/attention.py.
 */
#include <math.h>
#include <stdlib.h>

#include "vec.h"
#include "attention.h"

#define MR 8      /* rows of a product tile */
#define BLOCK 64  /* query rows per pass of a backward task over its head */
#define KEYS 32   /* key columns are padded to a multiple of this (two vectors) */
#define MAX_HEAD 256 /* widest head (attention.py's MAX_HEAD) */
#define MAX_KEYS 512 /* longest sequence (attention.py's MAX_TOKENS) */
#define MIN_PARALLEL_FLOP 2000000 /* below this much work a call runs on the caller's thread */

static inline int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

static inline int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

/* C[r][n] (+)= sum over k in [k0, k1) of A[r·sam + k·sak] · B[k·ldb + n], for rows r < mr (mr <= MR) and
 * columns n < N (a multiple of L), all f32: per k, the rows' A elements broadcast and a row of B read two
 * vectors at a time into MR x 2 accumulators held in registers. Rows past mr compute on whatever A holds
 * there (its buffers hold whole tiles) and are not stored. `add` keeps C's values, else C is overwritten.
 * Inlined into gemm_q, gemm_p and gemm_t, whose constant strides address A from one pointer. */
static inline __attribute__((always_inline)) void tile(int mr, int64_t N, int64_t k0, int64_t k1, const float *A,
                                                       int64_t sam, int64_t sak, const float *B, int64_t ldb,
                                                       float *C, int64_t ldc, int add) {
    int64_t n0 = 0;
    for (; n0 + 2 * L <= N; n0 += 2 * L) {
        v16 c0[MR], c1[MR];
        for (int r = 0; r < MR; ++r) {
            c0[r] = add && r < mr ? ld_f32(C + r * ldc + n0) : splat(0.f);
            c1[r] = add && r < mr ? ld_f32(C + r * ldc + n0 + L) : splat(0.f);
        }
        for (int64_t k = k0; k < k1; ++k) {
            const float *ak = A + k * sak, *bk = B + k * ldb + n0;
            const v16 b0 = ld_f32(bk), b1 = ld_f32(bk + L);
            for (int r = 0; r < MR; ++r) {
                const v16 av = splat(ak[r * sam]);
                c0[r] += av * b0;
                c1[r] += av * b1;
            }
        }
        for (int r = 0; r < mr; ++r) {
            st_f32(C + r * ldc + n0, c0[r]);
            st_f32(C + r * ldc + n0 + L, c1[r]);
        }
    }
    if (n0 < N) { /* one vector left */
        v16 c0[MR];
        for (int r = 0; r < MR; ++r) c0[r] = add && r < mr ? ld_f32(C + r * ldc + n0) : splat(0.f);
        for (int64_t k = k0; k < k1; ++k) {
            const float *ak = A + k * sak;
            const v16 b0 = ld_f32(B + k * ldb + n0);
            for (int r = 0; r < MR; ++r) c0[r] += splat(ak[r * sam]) * b0;
        }
        for (int r = 0; r < mr; ++r) st_f32(C + r * ldc + n0, c0[r]);
    }
}

#define QLD (MAX_HEAD + L)  /* row stride of the f32 copies of q and of out's gradient */
#define PLD (MAX_KEYS + L)  /* row stride of the scores, probabilities and their gradients */

/* A: rows of q or of out's gradient (stride QLD) */
static void gemm_q(int mr, int64_t N, int64_t k0, int64_t k1, const float *A, const float *B, int64_t ldb, float *C,
                   int64_t ldc) {
    tile(mr, N, k0, k1, A, QLD, 1, B, ldb, C, ldc, 0);
}

/* A: rows of probabilities or score gradients (stride PLD) */
static void gemm_p(int mr, int64_t N, int64_t k0, int64_t k1, const float *A, const float *B, int64_t ldb, float *C,
                   int64_t ldc) {
    tile(mr, N, k0, k1, A, PLD, 1, B, ldb, C, ldc, 0);
}

/* A transposed: A[r][k] = At[k·PLD + r], columns of probabilities or score gradients; C accumulates */
static void gemm_t(int mr, int64_t N, int64_t k0, int64_t k1, const float *At, const float *B, int64_t ldb, float *C,
                   int64_t ldc) {
    tile(mr, N, k0, k1, At, 1, PLD, B, ldb, C, ldc, 1);
}

/* One past the last key query i may see (0: none) */
static inline int64_t key_end(const uint8_t *allowed, int64_t T, int64_t i) {
    if (!allowed) return i + 1;
    const uint8_t *row = allowed + i * T;
    int64_t j = T;
    while (j > 0 && !row[j - 1]) --j;
    return j;
}

/* A row's score gradients from its probabilities p and their gradients dp (over dp): p (dp - rowdot) scale on
 * its computed columns [0, tw), where rowdot = sum_j p_j dp_j = dO·O; p and dS 0 on [tw, bw) */
static void score_gradient(float *p, float *dp, int64_t tw, int64_t bw, float rowdot, float scale) {
    for (int64_t j = 0; j < tw; j += L) st_f32(dp + j, ld_f32(p + j) * (ld_f32(dp + j) - rowdot) * scale);
    for (int64_t j = tw; j < bw; j += L) {
        st_f32(p + j, splat(0.f));
        st_f32(dp + j, splat(0.f));
    }
}

static inline float lane_sum(v16 v) {
    float sum = 0.f;
    for (int l = 0; l < L; ++l) sum += v[l];
    return sum;
}

static inline float lane_max(v16 v) {
    float m = -INFINITY;
    for (int l = 0; l < L; ++l) m = v[l] > m ? v[l] : m;
    return m;
}

/* One past the last key any query may see */
static int64_t keys_seen(const uint8_t *allowed, int64_t T) {
    int64_t end = 0;
    for (int64_t i = 0; i < T; ++i) end = max64(end, key_end(allowed, T, i));
    return end;
}

/* What a task (one query head of one sequence) works on: its sequence b, query head h and key/value head kvh,
 * its sequence's mask (NULL: causal), the keys any of its queries may see and their padded width */
typedef struct {
    int64_t b, h, kvh, kend, w;
    const uint8_t *mask;
} head_task;

static head_task head_of(int64_t task, int64_t H, int64_t Hkv, int64_t Tn, const uint8_t *allowed, int64_t mask_s) {
    head_task t = {.b = task / H, .h = task % H};
    t.kvh = t.h / (H / Hkv);
    t.mask = allowed ? allowed + t.b * mask_s : NULL;
    t.kend = keys_seen(t.mask, Tn);
    t.w = round_up(max64(t.kend, 1), KEYS);
    return t;
}

/* The scores s[j, j + L) of a row, scaled, where the row sees the key (below end, allowed by its mask row);
 * -inf in the other lanes, the lanes softmax_row and the bf16 rows softmax */
static inline v16 seen_scores(const float *s, int64_t j, int64_t end, const uint8_t *allowed_row, float scale) {
    v16 x = ld_f32(s + j) * scale;
    if (allowed_row || j + L > end) {
        i32x16 ok;
        for (int l = 0; l < L; ++l) ok[l] = j + l < end && (!allowed_row || allowed_row[j + l]) ? -1 : 0;
        x = vselect(ok, x, splat(-INFINITY));
    }
    return x;
}

/* Scores of row i (s, `width` columns computed) to probabilities: scaled, masked, softmaxed over its keys
 * [0, end); columns [end, width) set to 0. Returns the row's log-sum-exp (-inf for a row that sees nothing).
 * With lse given (backward), p = e^(s·scale - lse) instead of a fresh softmax. */
static float softmax_row(float *s, int64_t width, int64_t end, const uint8_t *allowed_row, float scale,
                         const float *lse) {
    for (int64_t j = 0; j < end; j += L) st_f32(s + j, seen_scores(s, j, end, allowed_row, scale));
    float m;
    if (lse) {
        m = *lse;
    } else {
        v16 top = splat(-INFINITY); /* masked and padded lanes hold -inf */
        for (int64_t j = 0; j < end; j += L) {
            const v16 x = ld_f32(s + j);
            top = vselect((i32x16)(x > top), x, top);
        }
        m = lane_max(top);
    }
    if (m == -INFINITY) { /* no key: probabilities 0 */
        memset(s, 0, width * sizeof(float));
        return -INFINITY;
    }
    v16 sum = splat(0.f);
    for (int64_t j = 0; j < end; j += L) {
        const v16 e = vexp_or_0(ld_f32(s + j) - m); /* masked and padded lanes: e^-inf = 0 */
        st_f32(s + j, e);
        sum += e;
    }
    for (int64_t j = round_up(end, L); j < width; j += L) st_f32(s + j, splat(0.f));
    if (lse) return m;
    const float total = lane_sum(sum);
    const float inv = 1.f / total;
    for (int64_t j = 0; j < end; j += L) st_f32(s + j, ld_f32(s + j) * inv);
    return m + logf(total);
}

typedef struct { int64_t s, h, t; } strides; /* a tensor's sequence, head and token strides */

/* rows [0, n) of a (tokens, D) matrix with token stride `ts`, copied `ld` apart */
static void rows(const float *src, int64_t ts, int64_t n, int64_t D, float *dst, int64_t ld) {
    for (int64_t i = 0; i < n; ++i)
        for (int64_t d = 0; d < D; d += L) st_f32(dst + i * ld + d, ld_f32(src + i * ts + d));
}

#ifdef GGTORCH_SHUFFLES
/* rows x[0..15] (16 x 16) transposed in registers: four rounds, each swapping one bit of the row index with the
 * same bit of the column index between row pairs (i, i + b) */
#define SWAP_BITS(b, ...)                                                                                    \
    for (int i = 0; i < L; ++i)                                                                             \
        if (!(i & (b))) {                                                                                   \
            const v16 lo = __builtin_shufflevector(x[i], x[i + (b)], __VA_ARGS__);                          \
            x[i + (b)] = __builtin_shufflevector(x[i], x[i + (b)], HI_##b);                                 \
            x[i] = lo;                                                                                      \
        }
#define HI_8 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31
#define HI_4 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31
#define HI_2 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31
#define HI_1 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31
static inline void transpose16(v16 x[L]) {
    SWAP_BITS(8, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
    SWAP_BITS(4, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27)
    SWAP_BITS(2, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29)
    SWAP_BITS(1, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30)
}
#endif

/* the same rows transposed: dst[d][i] for i < n, zero up to the padded width w (a multiple of L) */
static void cols(const float *src, int64_t ts, int64_t n, int64_t D, int64_t w, float *dst) {
#ifdef GGTORCH_SHUFFLES
    for (int64_t i0 = 0; i0 < w; i0 += L)
        for (int64_t d0 = 0; d0 < D; d0 += L) {
            v16 x[L];
            for (int r = 0; r < L; ++r) x[r] = i0 + r < n ? ld_f32(src + (i0 + r) * ts + d0) : splat(0.f);
            transpose16(x);
            for (int c = 0; c < L; ++c) st_f32(dst + (d0 + c) * w + i0, x[c]);
        }
#else
    for (int64_t i = 0; i < n; ++i)
        for (int64_t d = 0; d < D; ++d) dst[d * w + i] = src[i * ts + d];
    for (int64_t d = 0; d < D; ++d)
        for (int64_t i = n; i < w; ++i) dst[d * w + i] = 0.f;
#endif
}

/* rows of D back into a (tokens, D) matrix with token stride ts */
static void store(const float *src, int64_t n, int64_t D, float *dst, int64_t ts) {
    for (int64_t i = 0; i < n; ++i)
        for (int64_t d = 0; d < D; d += L) st_f32(dst + i * ts + d, ld_f32(src + i * D + d));
}

/* the same, rounded to bf16 */
static void store16(const float *src, int64_t n, int64_t D, uint16_t *dst, int64_t ts) {
    for (int64_t i = 0; i < n; ++i)
        for (int64_t d = 0; d < D; d += L) st_bf16(dst + i * ts + d, ld_f32(src + i * D + d));
}

/* each key/value head's gradients: the parts of its query heads summed in order, stored in f32 or bf16 */
static void reduce_parts(float *part, void *gk, void *gv, int bf16, int64_t B, int64_t H, int64_t Hkv, int64_t Tn,
                         int64_t D, strides gks, strides gvs, int threads) {
    const int64_t kv_heads = B * Hkv, G = H / Hkv;
    const int nt = team(threads, kv_heads * Tn * D * G, MIN_PARALLEL_FLOP / 16, kv_heads);
    (void)nt;
    PARALLEL_FOR
    for (int64_t task = 0; task < kv_heads; ++task) {
        const int64_t b = task / Hkv, kvh = task % Hkv;
        float *dk = part + (b * H + kvh * G) * 2 * Tn * D, *dv = dk + Tn * D;
        for (int64_t g = 1; g < G; ++g) {
            const float *pk = part + (b * H + kvh * G + g) * 2 * Tn * D, *pv = pk + Tn * D;
            for (int64_t e = 0; e < Tn * D; e += L) {
                st_f32(dk + e, ld_f32(dk + e) + ld_f32(pk + e));
                st_f32(dv + e, ld_f32(dv + e) + ld_f32(pv + e));
            }
        }
        const int64_t k0 = b * gks.s + kvh * gks.h, v0 = b * gvs.s + kvh * gvs.h;
        if (bf16) {
            store16(dk, Tn, D, (uint16_t *)gk + k0, gks.t);
            store16(dv, Tn, D, (uint16_t *)gv + v0, gvs.t);
        } else {
            store(dk, Tn, D, (float *)gk + k0, gks.t);
            store(dv, Tn, D, (float *)gv + v0, gvs.t);
        }
    }
}

/* ggtorch_attention: a task per query head of a sequence, its queries 8 at a time */
static int forward(const float *q, const float *k, const float *v, float *out, float *lse, int64_t B, int64_t H,
                   int64_t Hkv, int64_t Tn, int64_t D, strides qs, strides ks, strides vs, strides os,
                   const uint8_t *allowed, int64_t mask_s, float scale, int threads) {
    const int64_t tasks = B * H;
    int failed = 0;
    const int nt = team(threads, 2 * B * H * Tn * Tn * D, MIN_PARALLEL_FLOP, tasks);
    (void)nt;
    PARALLEL_FOR
    for (int64_t task = 0; task < tasks; ++task) {
        const head_task t = head_of(task, H, Hkv, Tn, allowed, mask_s);
        const int64_t b = t.b, h = t.h, kvh = t.kvh, kend = t.kend, w = t.w;
        const uint8_t *mask = t.mask;
        float *buf = malloc(sizeof(float) * (D * w + MR * QLD + MR * PLD + MR * D));
        if (!buf) {
            failed = 1;
            continue;
        }
        float *kt = buf, *qr = kt + D * w, *s = qr + MR * QLD, *o = s + MR * PLD;
        const float *vh = v + b * vs.s + kvh * vs.h; /* the values' rows, read where they are */
        cols(k + b * ks.s + kvh * ks.h, ks.t, kend, D, w, kt);
        for (int64_t t0 = 0; t0 < Tn; t0 += MR) {
            const int mr = (int)min64(MR, Tn - t0);
            int64_t ends[MR], tend = 0;
            for (int r = 0; r < mr; ++r) tend = max64(tend, ends[r] = key_end(mask, Tn, t0 + r));
            const int64_t tw = round_up(max64(tend, 1), KEYS);
            rows(q + b * qs.s + h * qs.h + t0 * qs.t, qs.t, mr, D, qr, QLD);
            gemm_q(mr, tw, 0, D, qr, kt, w, s, PLD);
            for (int r = 0; r < mr; ++r)
                lse[(b * H + h) * Tn + t0 + r] = softmax_row(s + r * PLD, tw, ends[r],
                                                             mask ? mask + (t0 + r) * Tn : NULL, scale, NULL);
            gemm_p(mr, D, 0, tend, s, vh, vs.t, o, D);
            store(o, mr, D, out + b * os.s + h * os.h + t0 * os.t, os.t);
        }
        free(buf);
    }
    return failed;
}

/* ggtorch_attention_backward: a task per query head of a sequence, its queries BLOCK at a time. The head's key
 * and value gradients accumulate in f32: in its own buffer, stored at the task's end, when no other query head
 * shares its key head; else in its part, summed over the heads that share them afterwards (reduce_parts). The
 * rows' dO·O are taken a block at a time, a pass over the block's rows of out, which a row at a time would
 * wait on memory for (out was written in forward, long out of cache). */
static int backward(const float *q, const float *k, const float *v, const float *out, const float *gout,
                    const float *lse, float *gq, float *gk, float *gv, float *part, int64_t B, int64_t H, int64_t Hkv,
                    int64_t Tn, int64_t D, strides qs, strides ks, strides vs, strides os, strides gos, strides gqs,
                    strides gks, strides gvs, const uint8_t *allowed, int64_t mask_s, float scale, int threads) {
    const int64_t tasks = B * H;
    int failed = 0;
    const int nt = team(threads, 4 * B * H * Tn * Tn * D, MIN_PARALLEL_FLOP, tasks);
    (void)nt;
    PARALLEL_FOR
    for (int64_t task = 0; task < tasks; ++task) {
        const head_task t = head_of(task, H, Hkv, Tn, allowed, mask_s);
        const int64_t b = t.b, h = t.h, kvh = t.kvh, kend = t.kend, w = t.w;
        const uint8_t *mask = t.mask;
        const int own = H == Hkv; /* the head's key and value gradients are its own: kept in its buffer */
        float *buf = malloc(sizeof(float) * (2 * D * w + 2 * BLOCK * QLD + BLOCK * D + 2 * BLOCK * PLD
                                             + (own ? 2 * Tn * D : 0)));
        if (!buf) {
            failed = 1;
            continue;
        }
        float *kt = buf, *vt = kt + D * w, *qr = vt + D * w;
        const float *kh = k + b * ks.s + kvh * ks.h; /* the keys' rows, read where they are */
        float *gr = qr + BLOCK * QLD, *dq = gr + BLOCK * QLD, *p = dq + BLOCK * D, *ds = p + BLOCK * PLD;
        float *dk = own ? ds + BLOCK * PLD : part + (b * H + h) * 2 * Tn * D, *dv = dk + Tn * D;
        memset(dk, 0, sizeof(float) * 2 * Tn * D);
        cols(k + b * ks.s + kvh * ks.h, ks.t, kend, D, w, kt);
        cols(v + b * vs.s + kvh * vs.h, vs.t, kend, D, w, vt);
        for (int64_t r0 = 0; r0 < Tn; r0 += BLOCK) {
            const int64_t r1 = min64(r0 + BLOCK, Tn), n = r1 - r0;
            int64_t ends[BLOCK], bend = 0;
            for (int64_t i = r0; i < r1; ++i) bend = max64(bend, ends[i - r0] = key_end(mask, Tn, i));
            const int64_t bw = round_up(max64(bend, 1), KEYS);
            rows(q + b * qs.s + h * qs.h + r0 * qs.t, qs.t, n, D, qr, QLD);
            rows(gout + b * gos.s + h * gos.h + r0 * gos.t, gos.t, n, D, gr, QLD);
            float rowdot[BLOCK]; /* dO·O of each row, the block's rows of out read in one pass */
            for (int64_t i = r0; i < r1; ++i) {
                const float *orow = out + b * os.s + h * os.h + i * os.t, *grow = gr + (i - r0) * QLD;
                v16 acc = splat(0.f);
                for (int64_t d = 0; d < D; d += L) acc += ld_f32(grow + d) * ld_f32(orow + d);
                rowdot[i - r0] = lane_sum(acc);
            }
            for (int64_t t0 = r0; t0 < r1; t0 += MR) {
                const int mr = (int)min64(MR, r1 - t0);
                int64_t tend = 0;
                for (int r = 0; r < mr; ++r) tend = max64(tend, ends[t0 - r0 + r]);
                const int64_t tw = round_up(max64(tend, 1), KEYS);
                float *pt = p + (t0 - r0) * PLD, *dst = ds + (t0 - r0) * PLD;
                gemm_q(mr, tw, 0, D, qr + (t0 - r0) * QLD, kt, w, pt, PLD);
                gemm_q(mr, tw, 0, D, gr + (t0 - r0) * QLD, vt, w, dst, PLD);
                for (int r = 0; r < mr; ++r) {
                    const int64_t i = t0 + r;
                    float *pr = pt + r * PLD, *dr = dst + r * PLD;
                    softmax_row(pr, tw, ends[i - r0], mask ? mask + i * Tn : NULL, scale,
                                lse + (b * H + h) * Tn + i);
                    score_gradient(pr, dr, tw, bw, rowdot[i - r0], scale);
                }
                gemm_p(mr, D, 0, tend, dst, kh, ks.t, dq + (t0 - r0) * D, D);
            }
            store(dq, n, D, gq + b * gqs.s + h * gqs.h + r0 * gqs.t, gqs.t);
            /* dK[j] += sum_i dS[i][j] q_i, dV[j] += sum_i p[i][j] dO_i over this block's rows */
            for (int64_t j0 = 0; j0 < bend; j0 += MR) {
                const int mr = (int)min64(MR, bend - j0);
                const int64_t i0 = allowed ? 0 : max64(0, j0 - r0); /* causal: rows before j0 see none */
                gemm_t(mr, D, i0, n, ds + j0, qr, QLD, dk + j0 * D, D);
                gemm_t(mr, D, i0, n, p + j0, gr, QLD, dv + j0 * D, D);
            }
        }
        if (own) {
            store(dk, Tn, D, (float *)gk + b * gks.s + kvh * gks.h, gks.t);
            store(dv, Tn, D, (float *)gv + b * gvs.s + kvh * gvs.h, gvs.t);
        }
        free(buf);
    }
    if (!failed && H != Hkv) reduce_parts(part, gk, gv, 0, B, H, Hkv, Tn, D, gks, gvs, threads);
    return failed;
}

#if defined(__AVX512BF16__) && defined(GGTORCH_SHUFFLES)
/* bf16 in and out: the products on the CPU's bf16 dot products (vdpbf16ps: two bf16 products a lane, summed in
 * f32), at twice the f32 multiply-adds' rate. A product's operands are read as pairs along its sum: an A
 * element is the 32-bit pair (A[r][k], A[r][k+1]), adjacent in rows whose sum runs along them (q, the
 * probabilities), and a row of B holds, lane by lane, the pair (B[k][n], B[k+1][n]): two rows of B interleaved
 * (pair_rows), or, where the sum runs along B's columns (k for the scores), its rows transposed as 32-bit pairs
 * (cols). Scores, softmax and their gradient stay f32; the probabilities and the score gradients are rounded
 * to bf16 for the products that take them, as torch's flash kernel does. */
#include <immintrin.h>

#define HALF_QLD (QLD / 2) /* the row strides above, in pairs */
#define HALF_PLD (PLD / 2)

typedef uint16_t u16x16v __attribute__((vector_size(32)));
typedef uint16_t u16x32v __attribute__((vector_size(64)));

/* C[r][n] (+)= sum over pairs p in [p0, p1) of A[r·sam + p·sak] · B[p·ldb + n] (pair by pair), as tile */
static inline __attribute__((always_inline)) void tile_bf16(int mr, int64_t N, int64_t p0, int64_t p1,
                                                            const uint32_t *A, int64_t sam, int64_t sak,
                                                            const uint32_t *B, int64_t ldb, float *C, int64_t ldc,
                                                            int add) {
    for (int64_t n0 = 0; n0 < N; n0 += 2 * L) {
        const int two = n0 + 2 * L <= N;
        __m512 c0[MR], c1[MR];
        for (int r = 0; r < MR; ++r) {
            c0[r] = add && r < mr ? _mm512_loadu_ps(C + r * ldc + n0) : _mm512_setzero_ps();
            c1[r] = add && r < mr && two ? _mm512_loadu_ps(C + r * ldc + n0 + L) : _mm512_setzero_ps();
        }
        for (int64_t p = p0; p < p1; ++p) {
            const uint32_t *ap = A + p * sak;
            const __m512bh b0 = (__m512bh)_mm512_loadu_si512(B + p * ldb + n0);
            const __m512bh b1 = two ? (__m512bh)_mm512_loadu_si512(B + p * ldb + n0 + L) : b0;
            for (int r = 0; r < MR; ++r) {
                const __m512bh av = (__m512bh)_mm512_set1_epi32((int)ap[r * sam]);
                c0[r] = _mm512_dpbf16_ps(c0[r], av, b0);
                c1[r] = _mm512_dpbf16_ps(c1[r], av, b1);
            }
        }
        for (int r = 0; r < mr; ++r) {
            _mm512_storeu_ps(C + r * ldc + n0, c0[r]);
            if (two) _mm512_storeu_ps(C + r * ldc + n0 + L, c1[r]);
        }
    }
}

static void bgemm_q(int mr, int64_t N, int64_t p0, int64_t p1, const uint32_t *A, const uint32_t *B, int64_t ldb,
                    float *C, int64_t ldc) {
    tile_bf16(mr, N, p0, p1, A, HALF_QLD, 1, B, ldb, C, ldc, 0);
}

static void bgemm_p(int mr, int64_t N, int64_t p0, int64_t p1, const uint32_t *A, const uint32_t *B, int64_t ldb,
                    float *C, int64_t ldc) {
    tile_bf16(mr, N, p0, p1, A, HALF_PLD, 1, B, ldb, C, ldc, 0);
}

static void bgemm_t(int mr, int64_t N, int64_t p0, int64_t p1, const uint32_t *At, const uint32_t *B, int64_t ldb,
                    float *C, int64_t ldc) {
    tile_bf16(mr, N, p0, p1, At, 1, PLD, B, ldb, C, ldc, 1);
}

/* rows [0, n) of a (tokens, D) bf16 matrix with token stride ts, copied ld apart */
static void rows16(const uint16_t *src, int64_t ts, int64_t n, int64_t D, uint16_t *dst, int64_t ld) {
    for (int64_t i = 0; i < n; ++i) memcpy(dst + i * ld, src + i * ts, D * sizeof(uint16_t));
}

/* rows 2p and 2p + 1 of a bf16 matrix (n rows of D, stride ts) interleaved into dst[p][d] = (x[2p][d], x[2p+1][d]),
 * ld pairs apart; the row after an odd n taken as zeros */
static void pair_rows(const uint16_t *src, int64_t ts, int64_t n, int64_t D, uint32_t *dst, int64_t ld) {
    for (int64_t p = 0; p < (n + 1) / 2; ++p)
        for (int64_t d = 0; d < D; d += L) {
            u16x16v a, b = {0};
            memcpy(&a, src + 2 * p * ts + d, sizeof a);
            if (2 * p + 1 < n) memcpy(&b, src + (2 * p + 1) * ts + d, sizeof b);
            const u16x32v x = __builtin_shufflevector(a, b, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                      8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
            memcpy(dst + p * ld + d, &x, sizeof x);
        }
}

/* softmax_row, its probabilities rounded into p16[0, width): the maximum, the exponentials (kept in s) with
 * their sum, then their quotients rounded, three passes over the row where softmax_row and a rounding take
 * five. The scores are scaled as they are read, each time alike. Returns the row's log-sum-exp. */
static float softmax_row16(float *s, int64_t width, int64_t end, const uint8_t *allowed_row, float scale,
                           uint16_t *p16) {
    v16 top = splat(-INFINITY);
    for (int64_t j = 0; j < end; j += L) {
        const v16 x = seen_scores(s, j, end, allowed_row, scale);
        top = vselect((i32x16)(x > top), x, top);
    }
    const float m = lane_max(top);
    if (m == -INFINITY) { /* no key: probabilities 0 */
        memset(p16, 0, width * sizeof(uint16_t));
        return -INFINITY;
    }
    v16 sum = splat(0.f);
    for (int64_t j = 0; j < end; j += L) {
        const v16 e = vexp_or_0(seen_scores(s, j, end, allowed_row, scale) - m);
        st_f32(s + j, e);
        sum += e;
    }
    const float total = lane_sum(sum);
    const float inv = 1.f / total;
    int64_t j = 0;
    for (; j < end; j += L) st_bf16(p16 + j, ld_f32(s + j) * inv); /* lanes past end hold e = 0 */
    for (; j < width; j += L) st_bf16(p16 + j, splat(0.f));
    return m + logf(total);
}

/* A row's probabilities p = e^(s·scale - lse) (softmax_row given lse) and score gradients dS = p (dp - rowdot)
 * scale (score_gradient) in one pass, rounded into p16 and ds16; both 0 past the computed columns tw up to bw
 * and in a row that sees no key (lse -inf) */
static void gradient_row16(const float *s, const float *dp, int64_t tw, int64_t bw, int64_t end,
                           const uint8_t *allowed_row, float scale, float lse, float rowdot, uint16_t *p16,
                           uint16_t *ds16) {
    int64_t j = 0;
    if (lse != -INFINITY)
        for (; j < tw; j += L) {
            const v16 p = vexp_or_0(seen_scores(s, j, end, allowed_row, scale) - lse);
            st_bf16(p16 + j, p);
            st_bf16(ds16 + j, p * (ld_f32(dp + j) - rowdot) * scale);
        }
    for (; j < bw; j += L) {
        st_bf16(p16 + j, splat(0.f));
        st_bf16(ds16 + j, splat(0.f));
    }
}

static int forward_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v, uint16_t *out, float *lse,
                        int64_t B, int64_t H, int64_t Hkv, int64_t Tn, int64_t D, strides qs, strides ks, strides vs,
                        strides os, const uint8_t *allowed, int64_t mask_s, float scale, int threads) {
    const int64_t tasks = B * H;
    int failed = 0;
    const int nt = team(threads, 2 * B * H * Tn * Tn * D, MIN_PARALLEL_FLOP, tasks);
    (void)nt;
    PARALLEL_FOR
    for (int64_t task = 0; task < tasks; ++task) {
        const head_task t = head_of(task, H, Hkv, Tn, allowed, mask_s);
        const int64_t b = t.b, h = t.h, kvh = t.kvh, kend = t.kend, w = t.w;
        const uint8_t *mask = t.mask;
        const int64_t half = (kend + 1) / 2;
        /* pairs: the keys' columns (D/2 x w), the values' rows (half x D); bf16: q's rows, probabilities */
        uint32_t *kp = malloc(sizeof(uint32_t) * (D / 2 * w + half * D + MR * HALF_QLD + MR * HALF_PLD));
        uint32_t *v2 = kp + D / 2 * w, *qr = v2 + half * D, *p16 = qr + MR * HALF_QLD;
        float *s = malloc(sizeof(float) * (MR * PLD + MR * D)), *o = s + MR * PLD;
        if (!kp || !s) {
            free(kp);
            free(s);
            failed = 1;
            continue;
        }
        cols((const float *)(k + b * ks.s + kvh * ks.h), ks.t / 2, kend, D / 2, w, (float *)kp);
        pair_rows(v + b * vs.s + kvh * vs.h, vs.t, kend, D, v2, D);
        for (int64_t t0 = 0; t0 < Tn; t0 += MR) {
            const int mr = (int)min64(MR, Tn - t0);
            int64_t ends[MR], tend = 0;
            for (int r = 0; r < mr; ++r) tend = max64(tend, ends[r] = key_end(mask, Tn, t0 + r));
            const int64_t tw = round_up(max64(tend, 1), KEYS);
            rows16(q + b * qs.s + h * qs.h + t0 * qs.t, qs.t, mr, D, (uint16_t *)qr, QLD);
            bgemm_q(mr, tw, 0, D / 2, qr, kp, w, s, PLD);
            for (int r = 0; r < mr; ++r) {
                lse[(b * H + h) * Tn + t0 + r] = softmax_row16(s + r * PLD, tw, ends[r],
                                                               mask ? mask + (t0 + r) * Tn : NULL, scale,
                                                               (uint16_t *)p16 + r * PLD);
            }
            bgemm_p(mr, D, 0, (tend + 1) / 2, p16, v2, D, o, D);
            store16(o, mr, D, out + b * os.s + h * os.h + t0 * os.t, os.t);
        }
        free(kp);
        free(s);
    }
    return failed;
}

static int backward_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v, const uint16_t *out,
                         const uint16_t *gout, const float *lse, uint16_t *gq, uint16_t *gk, uint16_t *gv, float *part,
                         int64_t B, int64_t H, int64_t Hkv, int64_t Tn, int64_t D, strides qs, strides ks, strides vs,
                         strides os, strides gos, strides gqs, strides gks, strides gvs, const uint8_t *allowed,
                         int64_t mask_s, float scale, int threads) {
    const int64_t tasks = B * H;
    int failed = 0;
    const int nt = team(threads, 4 * B * H * Tn * Tn * D, MIN_PARALLEL_FLOP, tasks);
    (void)nt;
    PARALLEL_FOR
    for (int64_t task = 0; task < tasks; ++task) {
        const head_task t = head_of(task, H, Hkv, Tn, allowed, mask_s);
        const int64_t b = t.b, h = t.h, kvh = t.kvh, kend = t.kend, w = t.w;
        const uint8_t *mask = t.mask;
        const int64_t half = (kend + 1) / 2;
        const int own = H == Hkv; /* as in backward */
        /* pairs: keys' and values' columns, keys' rows; q's and dO's rows (bf16) and row pairs; P, dS in bf16 and
         * as row pairs */
        uint32_t *kp = malloc(sizeof(uint32_t) * (D * w + half * D + 2 * BLOCK * HALF_QLD + BLOCK * D
                                                  + 2 * BLOCK * HALF_PLD + BLOCK * PLD));
        uint32_t *vp = kp + D / 2 * w, *k2 = vp + D / 2 * w, *qr = k2 + half * D, *gr = qr + BLOCK * HALF_QLD;
        uint32_t *q2 = gr + BLOCK * HALF_QLD, *g2 = q2 + BLOCK / 2 * D, *p16 = g2 + BLOCK / 2 * D;
        uint32_t *ds16 = p16 + BLOCK * HALF_PLD, *p2 = ds16 + BLOCK * HALF_PLD, *ds2 = p2 + BLOCK / 2 * PLD;
        float *p = malloc(sizeof(float) * (2 * BLOCK * PLD + BLOCK * D + (own ? 2 * Tn * D : 0)));
        if (!kp || !p) {
            free(kp);
            free(p);
            failed = 1;
            continue;
        }
        float *ds = p + BLOCK * PLD, *dq = ds + BLOCK * PLD;
        float *dk = own ? dq + BLOCK * D : part + (b * H + h) * 2 * Tn * D, *dv = dk + Tn * D;
        memset(dk, 0, sizeof(float) * 2 * Tn * D);
        const uint16_t *kh = k + b * ks.s + kvh * ks.h, *vh = v + b * vs.s + kvh * vs.h;
        cols((const float *)kh, ks.t / 2, kend, D / 2, w, (float *)kp);
        cols((const float *)vh, vs.t / 2, kend, D / 2, w, (float *)vp);
        pair_rows(kh, ks.t, kend, D, k2, D);
        for (int64_t r0 = 0; r0 < Tn; r0 += BLOCK) {
            const int64_t r1 = min64(r0 + BLOCK, Tn), n = r1 - r0;
            int64_t ends[BLOCK], bend = 0;
            for (int64_t i = r0; i < r1; ++i) bend = max64(bend, ends[i - r0] = key_end(mask, Tn, i));
            const int64_t bw = round_up(max64(bend, 1), KEYS);
            const uint16_t *qb = q + b * qs.s + h * qs.h + r0 * qs.t, *gb = gout + b * gos.s + h * gos.h + r0 * gos.t;
            rows16(qb, qs.t, n, D, (uint16_t *)qr, QLD);
            rows16(gb, gos.t, n, D, (uint16_t *)gr, QLD);
            pair_rows(qb, qs.t, n, D, q2, D);
            pair_rows(gb, gos.t, n, D, g2, D);
            float rowdot[BLOCK]; /* as in backward */
            for (int64_t i = r0; i < r1; ++i) {
                const uint16_t *orow = out + b * os.s + h * os.h + i * os.t, *grow = gb + (i - r0) * gos.t;
                v16 acc = splat(0.f);
                for (int64_t d = 0; d < D; d += L) acc += ld_bf16(grow + d) * ld_bf16(orow + d);
                rowdot[i - r0] = lane_sum(acc);
            }
            for (int64_t t0 = r0; t0 < r1; t0 += MR) {
                const int mr = (int)min64(MR, r1 - t0);
                int64_t tend = 0;
                for (int r = 0; r < mr; ++r) tend = max64(tend, ends[t0 - r0 + r]);
                const int64_t tw = round_up(max64(tend, 1), KEYS);
                float *pt = p + (t0 - r0) * PLD, *dst = ds + (t0 - r0) * PLD;
                bgemm_q(mr, tw, 0, D / 2, qr + (t0 - r0) * HALF_QLD, kp, w, pt, PLD);
                bgemm_q(mr, tw, 0, D / 2, gr + (t0 - r0) * HALF_QLD, vp, w, dst, PLD);
                for (int r = 0; r < mr; ++r) {
                    const int64_t i = t0 + r;
                    gradient_row16(pt + r * PLD, dst + r * PLD, tw, bw, ends[i - r0], mask ? mask + i * Tn : NULL,
                                   scale, lse[(b * H + h) * Tn + i], rowdot[i - r0], (uint16_t *)p16 + (i - r0) * PLD,
                                   (uint16_t *)ds16 + (i - r0) * PLD);
                }
                bgemm_p(mr, D, 0, (tend + 1) / 2, ds16 + (t0 - r0) * HALF_PLD, k2, D, dq + (t0 - r0) * D, D);
            }
            store16(dq, n, D, gq + b * gqs.s + h * gqs.h + r0 * gqs.t, gqs.t);
            pair_rows((const uint16_t *)p16, PLD, n, bw, p2, PLD);
            pair_rows((const uint16_t *)ds16, PLD, n, bw, ds2, PLD);
            for (int64_t j0 = 0; j0 < bend; j0 += MR) {
                const int mr = (int)min64(MR, bend - j0);
                const int64_t i0 = allowed ? 0 : max64(0, j0 - r0); /* even: causal rows before j0 see none */
                bgemm_t(mr, D, i0 / 2, (n + 1) / 2, ds2 + j0, q2, D, dk + j0 * D, D);
                bgemm_t(mr, D, i0 / 2, (n + 1) / 2, p2 + j0, g2, D, dv + j0 * D, D);
            }
        }
        if (own) {
            store16(dk, Tn, D, gk + b * gks.s + kvh * gks.h, gks.t);
            store16(dv, Tn, D, gv + b * gvs.s + kvh * gvs.h, gvs.t);
        }
        free(kp);
        free(p);
    }
    if (!failed && H != Hkv) reduce_parts(part, gk, gv, 1, B, H, Hkv, Tn, D, gks, gvs, threads);
    return failed;
}
#endif

int ggtorch_attention_bf16(void) {
#if defined(__AVX512BF16__) && defined(GGTORCH_SHUFFLES)
    return 1;
#else
    return 0;
#endif
}

static strides strides_of(const int64_t *s) { return (strides){s[0], s[1], s[2]}; }

int ggtorch_attention(const void *q, const void *k, const void *v, void *out, float *lse, int64_t B, int64_t H,
                      int64_t Hkv, int64_t T, int64_t D, const int64_t *st, const uint8_t *allowed, int64_t mask_s,
                      float scale, int bf16, int threads) {
#if defined(__AVX512BF16__) && defined(GGTORCH_SHUFFLES)
    if (bf16)
        return forward_bf16(q, k, v, out, lse, B, H, Hkv, T, D, strides_of(st), strides_of(st + 3),
                            strides_of(st + 6), strides_of(st + 9), allowed, mask_s, scale, threads);
#endif
    (void)bf16;
    return forward(q, k, v, out, lse, B, H, Hkv, T, D, strides_of(st), strides_of(st + 3), strides_of(st + 6),
                   strides_of(st + 9), allowed, mask_s, scale, threads);
}

int ggtorch_attention_backward(const void *q, const void *k, const void *v, const void *out, const void *gout,
                               const float *lse, void *gq, void *gk, void *gv, float *part, int64_t B, int64_t H,
                               int64_t Hkv, int64_t T, int64_t D, const int64_t *st, const uint8_t *allowed,
                               int64_t mask_s, float scale, int bf16, int threads) {
#if defined(__AVX512BF16__) && defined(GGTORCH_SHUFFLES)
    if (bf16)
        return backward_bf16(q, k, v, out, gout, lse, gq, gk, gv, part, B, H, Hkv, T, D, strides_of(st),
                             strides_of(st + 3), strides_of(st + 6), strides_of(st + 9), strides_of(st + 12),
                             strides_of(st + 15), strides_of(st + 18), strides_of(st + 21), allowed, mask_s, scale,
                             threads);
#endif
    (void)bf16;
    return backward(q, k, v, out, gout, lse, gq, gk, gv, part, B, H, Hkv, T, D, strides_of(st), strides_of(st + 3),
                    strides_of(st + 6), strides_of(st + 9), strides_of(st + 12), strides_of(st + 15),
                    strides_of(st + 18), strides_of(st + 21), allowed, mask_s, scale, threads);
}
