/* One-pass CPU decoders for the ggml types a quantized base is most often stored in.
 *
 * Each mirrors ggml's scalar dequantize_row_* (ggml-quants.c) and writes f32 in the same
 * order with the same operations, so the values are bit-equal to llama.cpp's and to the
 * torch decoders (tests/quant/test_native.py). Built and loaded by native.py; compiled with
 * -ffp-contract=off, so no product-and-subtract is contracted into an FMA (none would change
 * a value here: every product is exact in f32, but the rule keeps it so by construction).
 *
 * The torch decoders take several passes over the output (widen, subtract, scale, each a
 * kernel); here each block is read once and each value written once, which is what matters
 * when a matrix is decoded chunk by chunk between matrix products that have just evicted
 * the caches.
 */
#include "../ops/vec.h"
#include "native.h"

#define QK_K 256

static float f16_to_f32(const uint8_t *p) {
    const uint32_t h = (uint32_t)p[0] | ((uint32_t)p[1] << 8);
    const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    uint32_t bits;
    float f;
    if (exp == 0) { /* zero or subnormal: mant * 2^-24, exact in f32 */
        f = (float)mant * 5.9604644775390625e-8f;
        return sign ? -f : f;
    }
    if (exp == 31) bits = sign | 0x7f800000u | (mant << 13); /* inf, nan (payload kept) */
    else bits = sign | ((exp + 112u) << 23) | (mant << 13);
    memcpy(&f, &bits, 4);
    return f;
}

typedef uint8_t u8x16 __attribute__((vector_size(16)));

/* 16 quants as f32, each q - offset: the exact int-to-float conversion of ggml's loops, on 16 values at a time */
static inline v16 f32_of_u8(u8x16 q, int32_t offset) {
    return __builtin_convertvector(__builtin_convertvector(q, i32x16) - offset, v16);
}

/* block_q4_0: d (f16), qs[16]; dequantize_row_q4_0. The 16 bytes as one vector: low nibbles are values 0-15,
 * high nibbles 16-31, each (q - 8) * d, the same int-to-float conversion and product as ggml's loop; written as
 * vectors because GCC vectorizes the byte loop poorly for AVX-512 */
static void q4_0(const uint8_t *restrict x, float *restrict y, int64_t n) {
    for (int64_t i = 0; i < n; ++i, x += 18, y += 32) {
        const float d = f16_to_f32(x);
        u8x16 q;
        memcpy(&q, x + 2, sizeof q);
        st_f32(y, f32_of_u8(q & 0x0F, 8) * d);
        st_f32(y + L, f32_of_u8(q >> 4, 8) * d);
    }
}

/* block_q8_0: d (f16), qs[32] (int8); dequantize_row_q8_0 */
static void q8_0(const uint8_t *restrict x, float *restrict y, int64_t n) {
    for (int64_t i = 0; i < n; ++i, x += 34, y += 32) {
        const float d = f16_to_f32(x);
        const int8_t *qs = (const int8_t *)(x + 2);
        for (int j = 0; j < 32; ++j) y[j] = (float)qs[j] * d;
    }
}

/* get_scale_min_k4: the 6-bit scale and min of sub-block j from the 12 packed bytes */
static void scale_min_k4(int j, const uint8_t *q, uint8_t *sc, uint8_t *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* block_q4_K: d, dmin (f16), scales[12], qs[128]; dequantize_row_q4_K. Each 32 bytes of qs hold two sub-blocks,
 * low nibbles then high, each d1 * q - m1 as ggml computes it (no FMA: -ffp-contract=off), 16 values a vector */
static void q4_k(const uint8_t *restrict x, float *restrict y, int64_t n) {
    for (int64_t i = 0; i < n; ++i, x += 144) {
        const float d = f16_to_f32(x), min = f16_to_f32(x + 2);
        const uint8_t *scales = x + 4, *q = x + 16;
        uint8_t sc, m;
        for (int j = 0, is = 0; j < QK_K; j += 64, q += 32, is += 2, y += 64) {
            scale_min_k4(is, scales, &sc, &m);
            const float d1 = d * sc, m1 = min * m;
            scale_min_k4(is + 1, scales, &sc, &m);
            const float d2 = d * sc, m2 = min * m;
            for (int l = 0; l < 32; l += L) {
                u8x16 b;
                memcpy(&b, q + l, sizeof b);
                st_f32(y + l, d1 * f32_of_u8(b & 0x0F, 0) - m1);
                st_f32(y + 32 + l, d2 * f32_of_u8(b >> 4, 0) - m2);
            }
        }
    }
}

/* block_q5_K: d, dmin (f16), scales[12], qh[32], qs[128]; dequantize_row_q5_K. As q4_K, with bit 2 * (j / 64) of
 * qh[l] (low nibbles) or the bit above it (high nibbles) as the fifth bit: ggml adds 16, the same as or-ing it in */
static void q5_k(const uint8_t *restrict x, float *restrict y, int64_t n) {
    for (int64_t i = 0; i < n; ++i, x += 176) {
        const float d = f16_to_f32(x), min = f16_to_f32(x + 2);
        const uint8_t *scales = x + 4, *qh = x + 16, *ql = x + 48;
        uint8_t sc, m, u1 = 1, u2 = 2;
        for (int j = 0, is = 0; j < QK_K; j += 64, ql += 32, is += 2, u1 <<= 2, u2 <<= 2, y += 64) {
            scale_min_k4(is, scales, &sc, &m);
            const float d1 = d * sc, m1 = min * m;
            scale_min_k4(is + 1, scales, &sc, &m);
            const float d2 = d * sc, m2 = min * m;
            for (int l = 0; l < 32; l += L) {
                u8x16 b, h;
                memcpy(&b, ql + l, sizeof b);
                memcpy(&h, qh + l, sizeof h);
                st_f32(y + l, d1 * f32_of_u8((b & 0x0F) | ((u8x16)((h & u1) != 0) & 16), 0) - m1);
                st_f32(y + 32 + l, d2 * f32_of_u8((b >> 4) | ((u8x16)((h & u2) != 0) & 16), 0) - m2);
            }
        }
    }
}

/* block_q6_K: ql[128], qh[64], scales[16] (int8), d (f16); dequantize_row_q6_K. Quarter k of each half of 128
 * values: nibble k / 2 of ql[(k % 2) * 32 + l], bits 2k of qh[l], scale sc[2k + l / 16]; 16 values a vector */
static void q6_k(const uint8_t *restrict x, float *restrict y, int64_t n) {
    for (int64_t i = 0; i < n; ++i, x += 210) {
        const float d = f16_to_f32(x + 208);
        const uint8_t *restrict ql = x, *restrict qh = x + 128;
        const int8_t *restrict sc = (const int8_t *)(x + 192);
        for (int half = 0; half < 2; ++half, y += 128, ql += 64, qh += 32, sc += 8) {
            for (int k = 0; k < 4; ++k) {
                const int shift = (k / 2) * 4;
                for (int s = 0; s < 2; ++s) {
                    const float ds = d * sc[2 * k + s];
                    u8x16 lo, hi;
                    memcpy(&lo, ql + (k % 2) * 32 + 16 * s, sizeof lo);
                    memcpy(&hi, qh + 16 * s, sizeof hi);
                    const u8x16 q = ((lo >> shift) & 0x0F) | (((hi >> (2 * k)) & 3) << 4);
                    st_f32(y + 32 * k + 16 * s, ds * f32_of_u8(q, 32));
                }
            }
        }
    }
}

typedef void (*decoder)(const uint8_t *, float *, int64_t);

/* the types decoded here, by ggml type id (ggml.h's enum ggml_type, gguf's GGMLQuantizationType) */
static const struct { int ggml_type; decoder fn; int type_size, block_size; } TYPES[] = {
    {2, q4_0, 18, 32}, {8, q8_0, 34, 32}, {12, q4_k, 144, QK_K}, {13, q5_k, 176, QK_K}, {14, q6_k, 210, QK_K},
};
#define N_TYPES (int)(sizeof(TYPES) / sizeof(TYPES[0]))

#define BF16_GROUP 4096 /* values decoded to f32 on the stack, then rounded: 16 KiB, in L1 */

/* One thread's share: n blocks into f32 (bf16 == 0) or into bf16 through a small f32 buffer. */
static void decode_share(decoder fn, const uint8_t *src, void *dst, int64_t n, int64_t type_size,
                         int64_t block_size, int bf16) {
    if (!bf16) {
        fn(src, (float *)dst, n);
        return;
    }
    float buf[BF16_GROUP];
    const int64_t group = BF16_GROUP / block_size;
    uint16_t *out = dst;
    for (int64_t b = 0; b < n; b += group) {
        const int64_t nb = n - b < group ? n - b : group;
        fn(src + b * type_size, buf, nb);
        for (int64_t i = 0; i < nb * block_size; ++i) out[b * block_size + i] = bf16_of(buf[i]);
    }
}

int ggtorch_dequantize(int ggml_type, const uint8_t *src, void *dst, int64_t n_blocks, int threads, int bf16) {
    int t = 0;
    while (t < N_TYPES && TYPES[t].ggml_type != ggml_type) ++t;
    if (t == N_TYPES) return -1;
    const decoder fn = TYPES[t].fn;
    const int64_t type_size = TYPES[t].type_size, block_size = TYPES[t].block_size;
    const int64_t value_size = bf16 ? 2 : 4;
    if (threads < 1 || n_blocks < 2 * threads) threads = 1;
    const int64_t per = n_blocks / threads, extra = n_blocks % threads;
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(static, 1)
#endif
    for (int k = 0; k < threads; ++k) {
        const int64_t b0 = k * per + (k < extra ? k : extra);
        decode_share(fn, src + b0 * type_size, (uint8_t *)dst + b0 * block_size * value_size, per + (k < extra),
                     type_size, block_size, bf16);
    }
    return 0;
}

int ggtorch_native_types(int *out, int capacity) {
    for (int t = 0; t < N_TYPES && t < capacity; ++t) out[t] = TYPES[t].ggml_type;
    return N_TYPES;
}
