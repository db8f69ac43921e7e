/* What fused.c exports (the fused norm, gated units, rope and slab softmax). fused.py reads each function's ctypes signature from these
 * prototypes (ggtorch.ops.clib.prototypes) and fused.c includes this header, so the compiler holds each
 * definition to the signature Python calls. */
#ifndef GGTORCH_FUSED_H
#define GGTORCH_FUSED_H

#include <stdint.h>

/* out = act(g) * u over n elements, f32 or bf16 (`bf16` not 0): silu (SwiGLU), or with `gelu` GELU's tanh
 * approximation (GeGLU). */
void ggtorch_glu(const void *g, const void *u, void *out, int64_t n, int gelu, int bf16, int threads);

/* The gradients of act(g) * u for the output's gradient `grad`; grad_g or grad_u may be NULL. */
void ggtorch_glu_backward(const void *g, const void *u, const void *grad, void *grad_g, void *grad_u, int64_t n,
                          int gelu, int bf16, int threads);

/* RMSNorm of rows × C values x (f32 or bf16) with f32 gain w: out in x's dtype, rstd (rows) f32. */
void ggtorch_rms_norm(const void *x, const float *w, void *out, float *rstd, int64_t rows, int64_t C, float eps,
                      int bf16, int threads);

/* The input gradient of RMSNorm for the output's gradient `grad` (x's dtype), from the forward's rstd. */
void ggtorch_rms_norm_backward(const void *x, const float *w, const float *rstd, const void *grad, void *grad_x,
                               int64_t rows, int64_t C, int bf16, int threads);

/* One slab of the online softmax over logits x (f32 or bf16, in place; see SOFTMAX_SLAB). Returns how many rows'
 * sums were rescaled (rescale[i] != 1). */
int64_t ggtorch_softmax_slab(void *x, int64_t rows, int64_t width, int64_t ld, const int64_t *targets, int64_t v0,
                             float *run_max, float *run_sum, float *picked, float *rescale, float headroom, int bf16,
                             int threads);

/* Rope of x (rows = B * T, H heads of 2 * half values; f32 or bf16) into out (x's dtype) by the angles' cos and
 * sin (f32: T rows, or one per row of x with `per_row`); `sign` -1 rotates back (the backward). Returns 0, or -1
 * for heads wider than ROPE_MAX_D or in a build without rope (ggtorch_rope_built). */
int ggtorch_rope(const void *x, const float *cos, const float *sin, void *out, int64_t rows, int64_t T, int64_t H,
                 int64_t half, int halves, int per_row, float sign, int bf16, int threads);

/* 1 when this build has rope (the compiler has __builtin_shufflevector), else 0. */
int ggtorch_rope_built(void);

#endif
