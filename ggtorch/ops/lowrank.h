/* What lowrank.c exports (LoRA's rank-r products). lowrank.py reads each function's ctypes signature from these
 * prototypes (ggtorch.ops.clib.prototypes) and lowrank.c includes this header, so the compiler holds each
 * definition to the signature Python calls. */
#ifndef GGTORCH_LOWRANK_H
#define GGTORCH_LOWRANK_H

#include <stdint.h>

/* out (N, r) = s * x (N, K) @ m (r, K).T, in x's dtype (bf16 when `bf16` is not 0, else f32). */
void ggtorch_lowrank_project(const void *x, const void *m, void *out, int64_t N, int64_t K, int r, float s,
                             int bf16, int threads);

/* y (N, M) += s * h (N, r) @ mt (r, M), all in one dtype; r at most MAX_R (returns -1 past it). */
int ggtorch_lowrank_expand(void *y, const void *h, const void *mt, int64_t N, int64_t M, int r, float s, int bf16,
                           int threads);

/* g (r, K) = s * h (N, r).T @ x (N, K), in f32 whatever the operands' dtype. */
void ggtorch_lowrank_reduce(const void *x, const void *h, float *g, int64_t N, int64_t K, int r, float s, int bf16,
                            int threads);

#endif
