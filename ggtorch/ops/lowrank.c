/* The rank-r products of a LoRA step on CPU: x @ A.T, y += s * h @ B.T and h.T @ x, in f32 or bf16.
 *
 * With r a few columns wide, a BLAS or oneDNN GEMM spends most of its time on packing and on edge
 * cases for these shapes and reads its operands several times; each of them is a stream over one
 * big activation (N rows of the layer's width) and a small matrix that stays in L1. Here each loop
 * reads the big operand once, in 16-wide vectors (GCC/Clang vector extensions: AVX-512, AVX2, NEON or
 * plain scalar code, whatever the target has), and accumulates in f32. bf16 operands are widened on
 * load and results rounded to nearest even on store, as torch rounds.
 *
 * Every output element is computed by one thread in a fixed order, so the results do not depend on
 * the number of threads. Built and loaded by ggtorch/ops/lowrank.py (ggtorch/ops/clib.py).
 */
#include "vec.h"
#include "lowrank.h"

#define RB 4 /* rows of the small matrix per pass (the registers one pass accumulates in) */
#define TILE 64 /* columns per tile of lowrank_reduce: 4 vectors */
#define MAX_R 64 /* widest r of lowrank_expand (the policy's lowrank_max_rank is lower) */

/* Below this many multiply-adds a call runs on the caller's thread: waking the team costs more. */
#define MIN_PARALLEL_MACS (1 << 16)

#define KERNELS(T, SUFFIX, LD, ST, GET, SET)                                                                  \
    /* out[i, j] = s * sum_k x[i, k] m[j, k] for up to 4 rows i of x and up to RB rows j of m */             \
    static void project_block_##SUFFIX(const T *x, int64_t K, const T *m, int rows, int js, float s,        \
                                       T *out, int r) {                                                     \
        v16 acc[4][RB];                                                                                     \
        memset(acc, 0, sizeof acc);                                                                         \
        int64_t k = 0;                                                                                      \
        for (; k + L <= K; k += L) {                                                                        \
            v16 xv[4];                                                                                      \
            for (int i = 0; i < rows; ++i) xv[i] = LD(x + i * K + k);                                       \
            for (int j = 0; j < js; ++j) {                                                                  \
                const v16 mv = LD(m + j * K + k);                                                           \
                for (int i = 0; i < rows; ++i) acc[i][j] += xv[i] * mv;                                     \
            }                                                                                               \
        }                                                                                                   \
        for (int i = 0; i < rows; ++i)                                                                      \
            for (int j = 0; j < js; ++j) {                                                                  \
                float t = 0.f;                                                                              \
                for (int l = 0; l < L; ++l) t += acc[i][j][l];                                              \
                for (int64_t kk = k; kk < K; ++kk) t += GET(x + i * K + kk) * GET(m + j * K + kk);          \
                SET(out + i * r + j, s * t);                                                                \
            }                                                                                               \
    }                                                                                                       \
                                                                                                            \
    static void project_##SUFFIX(const T *x, const T *m, T *out, int64_t N, int64_t K, int r, float s,      \
                                 int threads) {                                                             \
        const int64_t blocks = (N + 3) / 4;                                                                 \
        const int nt = team(threads, N * K * r, MIN_PARALLEL_MACS, blocks);                                 \
        (void)nt;                                                                                           \
        PARALLEL_FOR                                                                                        \
        for (int64_t b = 0; b < blocks; ++b) {                                                              \
            const int64_t i0 = b * 4;                                                                       \
            const int rows = N - i0 < 4 ? (int)(N - i0) : 4;                                                \
            for (int j0 = 0; j0 < r; j0 += RB) {                                                            \
                const int js = r - j0 < RB ? r - j0 : RB;                                                   \
                if (rows == 4 && js == RB) /* the common case, with constant trip counts */               \
                    project_block_##SUFFIX(x + i0 * K, K, m + j0 * K, 4, RB, s, out + i0 * r + j0, r);      \
                else                                                                                        \
                    project_block_##SUFFIX(x + i0 * K, K, m + j0 * K, rows, js, s, out + i0 * r + j0, r);   \
            }                                                                                               \
        }                                                                                                   \
    }                                                                                                       \
                                                                                                            \
    /* y[i, :] += s * sum_j h[i, j] mt[j, :] for up to 4 rows i: each vector of mt is loaded once for the rows */  \
    static void expand_block_##SUFFIX(T *y, const T *h, const T *mt, int64_t M, int rows, int r, float s) {   \
        float hs[4][MAX_R];                                                                                 \
        for (int i = 0; i < rows; ++i)                                                                      \
            for (int j = 0; j < r; ++j) hs[i][j] = s * GET(h + i * r + j);                                  \
        int64_t o = 0;                                                                                      \
        for (; o + L <= M; o += L) {                                                                        \
            v16 a[4];                                                                                       \
            for (int i = 0; i < rows; ++i) a[i] = LD(y + i * M + o);                                        \
            for (int j = 0; j < r; ++j) {                                                                   \
                const v16 mv = LD(mt + j * M + o);                                                          \
                for (int i = 0; i < rows; ++i) a[i] += hs[i][j] * mv;                                       \
            }                                                                                               \
            for (int i = 0; i < rows; ++i) ST(y + i * M + o, a[i]);                                         \
        }                                                                                                   \
        for (; o < M; ++o)                                                                                  \
            for (int i = 0; i < rows; ++i) {                                                                \
                float a = GET(y + i * M + o);                                                               \
                for (int j = 0; j < r; ++j) a += hs[i][j] * GET(mt + j * M + o);                            \
                SET(y + i * M + o, a);                                                                      \
            }                                                                                               \
    }                                                                                                       \
                                                                                                            \
    static void expand_##SUFFIX(T *y, const T *h, const T *mt, int64_t N, int64_t M, int r, float s,        \
                                int threads) {                                                              \
        const int64_t blocks = (N + 3) / 4;                                                                 \
        const int nt = team(threads, N * M * r, MIN_PARALLEL_MACS, blocks);                                 \
        (void)nt;                                                                                           \
        PARALLEL_FOR                                                                                        \
        for (int64_t b = 0; b < blocks; ++b) {                                                              \
            const int64_t i0 = b * 4;                                                                       \
            const int rows = N - i0 < 4 ? (int)(N - i0) : 4;                                                \
            if (rows == 4) /* the common case, with a constant trip count */                                \
                expand_block_##SUFFIX(y + i0 * M, h + i0 * r, mt, M, 4, r, s);                              \
            else                                                                                            \
                expand_block_##SUFFIX(y + i0 * M, h + i0 * r, mt, M, rows, r, s);                           \
        }                                                                                                   \
    }                                                                                                       \
                                                                                                            \
    /* g[j, :] = s * sum_i h[i, j] x[i, :], f32; a tile of TILE columns per task */                          \
    static void reduce_##SUFFIX(const T *x, const T *h, float *g, int64_t N, int64_t K, int r, float s,     \
                                int threads) {                                                              \
        const int64_t tiles = (K + TILE - 1) / TILE;                                                        \
        const int nt = team(threads, N * K * r, MIN_PARALLEL_MACS, tiles);                                  \
        (void)nt;                                                                                           \
        PARALLEL_FOR                                                                                        \
        for (int64_t t = 0; t < tiles; ++t) {                                                               \
            const int64_t k0 = t * TILE, w = K - k0 < TILE ? K - k0 : TILE;                                 \
            for (int j0 = 0; j0 < r; j0 += RB) {                                                            \
                const int js = r - j0 < RB ? r - j0 : RB;                                                   \
                if (w == TILE) {                                                                            \
                    v16 acc[RB][TILE / L];                                                                  \
                    memset(acc, 0, sizeof acc);                                                             \
                    for (int64_t i = 0; i < N; ++i) {                                                       \
                        v16 xv[TILE / L];                                                                   \
                        for (int q = 0; q < TILE / L; ++q) xv[q] = LD(x + i * K + k0 + q * L);              \
                        for (int j = 0; j < js; ++j) {                                                      \
                            const float c = GET(h + i * r + j0 + j);                                        \
                            for (int q = 0; q < TILE / L; ++q) acc[j][q] += c * xv[q];                      \
                        }                                                                                   \
                    }                                                                                       \
                    for (int j = 0; j < js; ++j)                                                            \
                        for (int q = 0; q < TILE / L; ++q) st_f32(g + (j0 + j) * K + k0 + q * L, s * acc[j][q]); \
                } else {                                                                                    \
                    float acc[RB][TILE];                                                                    \
                    memset(acc, 0, sizeof acc);                                                             \
                    for (int64_t i = 0; i < N; ++i)                                                         \
                        for (int j = 0; j < js; ++j) {                                                      \
                            const float c = GET(h + i * r + j0 + j);                                        \
                            for (int64_t l = 0; l < w; ++l) acc[j][l] += c * GET(x + i * K + k0 + l);       \
                        }                                                                                   \
                    for (int j = 0; j < js; ++j)                                                            \
                        for (int64_t l = 0; l < w; ++l) g[(j0 + j) * K + k0 + l] = s * acc[j][l];           \
                }                                                                                           \
            }                                                                                               \
        }                                                                                                   \
    }

KERNELS(float, f32, ld_f32, st_f32, f32_of_f32, set_f32)
KERNELS(uint16_t, bf16, ld_bf16, st_bf16, f32_of_bf16, set_bf16)

void ggtorch_lowrank_project(const void *x, const void *m, void *out, int64_t N, int64_t K, int r, float s,
                             int bf16, int threads) {
    if (bf16) project_bf16(x, m, out, N, K, r, s, threads);
    else project_f32(x, m, out, N, K, r, s, threads);
}

int ggtorch_lowrank_expand(void *y, const void *h, const void *mt, int64_t N, int64_t M, int r, float s, int bf16,
                           int threads) {
    if (r > MAX_R) return -1;
    if (bf16) expand_bf16(y, h, mt, N, M, r, s, threads);
    else expand_f32(y, h, mt, N, M, r, s, threads);
    return 0;
}

void ggtorch_lowrank_reduce(const void *x, const void *h, float *g, int64_t N, int64_t K, int r, float s, int bf16,
                            int threads) {
    if (bf16) reduce_bf16(x, h, g, N, K, r, s, threads);
    else reduce_f32(x, h, g, N, K, r, s, threads);
}
