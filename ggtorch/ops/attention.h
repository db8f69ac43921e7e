/* What attention.c exports (training attention). attention.py reads each function's ctypes signature from these
 * prototypes (ggtorch.ops.clib.prototypes) and attention.c includes this header, so the compiler holds each
 * definition to the signature Python calls. */
#ifndef GGTORCH_ATTENTION_H
#define GGTORCH_ATTENTION_H

#include <stdint.h>

/* Whether the library computes bf16 attention (the compiler targets the CPU's bf16 dot products) */
int ggtorch_attention_bf16(void);

/* softmax(q k^T · scale, masked) v into out, each row's log-sum-exp into lse (B, H, T); `st` holds the
 * strides of q, k, v, out (3 each). Returns 0, or 1 when a task's buffers could not be allocated. */
int ggtorch_attention(const void *q, const void *k, const void *v, void *out, float *lse, int64_t B, int64_t H,
                      int64_t Hkv, int64_t T, int64_t D, const int64_t *st, const uint8_t *allowed, int64_t mask_s,
                      float scale, int bf16, int threads);

/* The gradients of q, k and v from out's gradient; `st` holds the strides of q, k, v, out, grad_out, grad_q,
 * grad_k, grad_v (3 each), `part` room for 2·B·H·T·D floats (each query head's key and value gradients) when
 * Hkv < H (unused, and may be NULL, when every query head has its own key and value heads).
 * Returns 0, or 1 when a task's buffers could not be allocated. */
int ggtorch_attention_backward(const void *q, const void *k, const void *v, const void *out, const void *gout,
                               const float *lse, void *gq, void *gk, void *gv, float *part, int64_t B, int64_t H,
                               int64_t Hkv, int64_t T, int64_t D, const int64_t *st, const uint8_t *allowed,
                               int64_t mask_s, float scale, int bf16, int threads);

#endif
