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
typedef int8_t i8x16 __attribute__((vector_size(16)));

#define INLINE static inline __attribute__((always_inline))

/* 16 quants as f32, each q - offset: the exact int-to-float conversion of ggml's loops, on 16 values at a time */
INLINE v16 f32_of_u8(u8x16 q, int32_t offset) {
    return __builtin_convertvector(__builtin_convertvector(q, i32x16) - offset, v16);
}

/* 16 values into y at value i: f32, or bf16 rounded as torch rounds (bf16 is a constant where it is inlined).
 * `numbers`: the block's scales are finite, so no value is NaN (a finite scale times a quant, less a finite min,
 * is a number or infinite) and the rounding needs no NaN lanes */
INLINE void put(void *restrict y, int64_t i, v16 v, const int bf16, const int numbers) {
    if (!bf16) st_f32((float *)y + i, v);
    else if (numbers) st_high_halves((uint16_t *)y + i, bf16_bits_of_numbers(v));
    else st_bf16((uint16_t *)y + i, v);
}

INLINE int finite_scale(float f) { return f - f == 0.f; }

static const v16 IOTA = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define LOOKUP 1
/* A 4-bit type has 16 values per scale: each is computed once, as ggml computes it, into a table, and the
 * nibbles pick their values from it (vpermps, vpermw). The same values, bit for bit, in a fraction of the
 * arithmetic: what a decoder between matrix products is bound by. */

/* 32 values at y + i from 32 nibbles (indices 0-15, one a byte) through the 16-entry table t (f32): two vpermps,
 * or one vpermw picking the high half of each entry's bf16 rounding (word 2q + 1 of the rounded lanes) */
INLINE void put_lookup32(void *restrict y, int64_t i, __m256i idx, v16 t, const int bf16, const int numbers) {
    if (bf16) {
        const u32x16 bits = numbers ? bf16_bits_of_numbers(t) : bf16_bits(t);
        __m512i table;
        memcpy(&table, &bits, sizeof table);
        const __m512i words = _mm512_cvtepu8_epi16(idx);
        const __m512i high = _mm512_or_si512(_mm512_add_epi16(words, words), _mm512_set1_epi16(1));
        _mm512_storeu_si512((uint16_t *)y + i, _mm512_permutexvar_epi16(high, table));
    } else {
        __m512 table;
        memcpy(&table, &t, sizeof table);
        _mm512_storeu_ps((float *)y + i, _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(idx)), table));
        _mm512_storeu_ps((float *)y + i + 16,
                         _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(idx, 1)), table));
    }
}
#endif

/* block_q4_0: d (f16), qs[16]; dequantize_row_q4_0. The 16 bytes as one vector: low nibbles are values 0-15,
 * high nibbles 16-31, each (q - 8) * d, the same int-to-float conversion and product as ggml's loop */
INLINE void q4_0(const uint8_t *restrict x, void *restrict y, int64_t n, const int bf16) {
    for (int64_t i = 0; i < n; ++i, x += 18) {
        const float d = f16_to_f32(x);
#ifdef LOOKUP
        const v16 t = (IOTA - 8.f) * d; /* (q - 8) * d for q = 0..15: q - 8 is exact in f32 */
        const __m128i b = _mm_loadu_si128((const __m128i *)(x + 2));
        const __m128i lo = _mm_and_si128(b, _mm_set1_epi8(0x0F)), hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0x0F));
        put_lookup32(y, 32 * i, _mm256_set_m128i(hi, lo), t, bf16, finite_scale(d));
#else
        u8x16 q;
        memcpy(&q, x + 2, sizeof q);
        put(y, 32 * i, f32_of_u8(q & 0x0F, 8) * d, bf16, finite_scale(d));
        put(y, 32 * i + L, f32_of_u8(q >> 4, 8) * d, bf16, finite_scale(d));
#endif
    }
}

/* block_q8_0: d (f16), qs[32] (int8); dequantize_row_q8_0 */
INLINE void q8_0(const uint8_t *restrict x, void *restrict y, int64_t n, const int bf16) {
    for (int64_t i = 0; i < n; ++i, x += 34) {
        const float d = f16_to_f32(x);
        for (int l = 0; l < 32; l += L) {
            i8x16 q;
            memcpy(&q, x + 2 + l, sizeof q);
            put(y, 32 * i + l, __builtin_convertvector(q, v16) * d, bf16, finite_scale(d));
        }
    }
}

/* get_scale_min_k4: the 6-bit scale and min of sub-block j from the 12 packed bytes */
INLINE void scale_min_k4(int j, const uint8_t *q, uint8_t *sc, uint8_t *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* block_q4_K: d, dmin (f16), scales[12], qs[128]; dequantize_row_q4_K. Each 32 bytes of qs hold two sub-blocks,
 * low nibbles then high, each d1 * q - m1 as ggml computes it (no FMA: -ffp-contract=off) */
INLINE void q4_k(const uint8_t *restrict x, void *restrict y, int64_t n, const int bf16) {
    for (int64_t i = 0, o = 0; i < n; ++i, x += 144) {
        const float d = f16_to_f32(x), min = f16_to_f32(x + 2);
        const int numbers = finite_scale(d) && finite_scale(min);
        const uint8_t *scales = x + 4, *q = x + 16;
        uint8_t sc, m;
        for (int j = 0, is = 0; j < QK_K; j += 64, q += 32, is += 2, o += 64) {
            scale_min_k4(is, scales, &sc, &m);
            const float d1 = d * sc, m1 = min * m;
            scale_min_k4(is + 1, scales, &sc, &m);
            const float d2 = d * sc, m2 = min * m;
#ifdef LOOKUP
            const __m256i b = _mm256_loadu_si256((const __m256i *)q), low = _mm256_set1_epi8(0x0F);
            put_lookup32(y, o, _mm256_and_si256(b, low), d1 * IOTA - m1, bf16, numbers);
            put_lookup32(y, o + 32, _mm256_and_si256(_mm256_srli_epi16(b, 4), low), d2 * IOTA - m2, bf16, numbers);
#else
            for (int l = 0; l < 32; l += L) {
                u8x16 b;
                memcpy(&b, q + l, sizeof b);
                put(y, o + l, d1 * f32_of_u8(b & 0x0F, 0) - m1, bf16, numbers);
                put(y, o + 32 + l, d2 * f32_of_u8(b >> 4, 0) - m2, bf16, numbers);
            }
#endif
        }
    }
}

/* block_q5_K: d, dmin (f16), scales[12], qh[32], qs[128]; dequantize_row_q5_K. As q4_K, with bit 2 * (j / 64) of
 * qh[l] (low nibbles) or the bit above it (high nibbles) as the fifth bit: ggml adds 16, the same as or-ing it in */
INLINE void q5_k(const uint8_t *restrict x, void *restrict y, int64_t n, const int bf16) {
    for (int64_t i = 0, o = 0; i < n; ++i, x += 176) {
        const float d = f16_to_f32(x), min = f16_to_f32(x + 2);
        const int numbers = finite_scale(d) && finite_scale(min);
        const uint8_t *scales = x + 4, *qh = x + 16, *ql = x + 48;
        uint8_t sc, m, u1 = 1, u2 = 2;
        for (int j = 0, is = 0; j < QK_K; j += 64, ql += 32, is += 2, u1 <<= 2, u2 <<= 2, o += 64) {
            scale_min_k4(is, scales, &sc, &m);
            const float d1 = d * sc, m1 = min * m;
            scale_min_k4(is + 1, scales, &sc, &m);
            const float d2 = d * sc, m2 = min * m;
            for (int l = 0; l < 32; l += L) {
                u8x16 b, h;
                memcpy(&b, ql + l, sizeof b);
                memcpy(&h, qh + l, sizeof h);
                put(y, o + l, d1 * f32_of_u8((b & 0x0F) | ((u8x16)((h & u1) != 0) & 16), 0) - m1, bf16, numbers);
                put(y, o + 32 + l, d2 * f32_of_u8((b >> 4) | ((u8x16)((h & u2) != 0) & 16), 0) - m2, bf16, numbers);
            }
        }
    }
}

/* block_q6_K: ql[128], qh[64], scales[16] (int8), d (f16); dequantize_row_q6_K. Quarter k of each half of 128
 * values: nibble k / 2 of ql[(k % 2) * 32 + l], bits 2k of qh[l], scale sc[2k + l / 16]; 16 values a vector */
INLINE void q6_k(const uint8_t *restrict x, void *restrict y, int64_t n, const int bf16) {
    for (int64_t i = 0, o = 0; i < n; ++i, x += 210) {
        const float d = f16_to_f32(x + 208);
        const uint8_t *restrict ql = x, *restrict qh = x + 128;
        const int8_t *restrict sc = (const int8_t *)(x + 192);
        for (int half = 0; half < 2; ++half, o += 128, ql += 64, qh += 32, sc += 8) {
            for (int k = 0; k < 4; ++k) {
                const int shift = (k / 2) * 4;
                for (int s = 0; s < 2; ++s) {
                    const float ds = d * sc[2 * k + s];
                    u8x16 lo, hi;
                    memcpy(&lo, ql + (k % 2) * 32 + 16 * s, sizeof lo);
                    memcpy(&hi, qh + 16 * s, sizeof hi);
                    const u8x16 q = ((lo >> shift) & 0x0F) | (((hi >> (2 * k)) & 3) << 4);
                    put(y, o + 32 * k + 16 * s, ds * f32_of_u8(q, 32), bf16, finite_scale(d));
                }
            }
        }
    }
}

typedef void (*decoder)(const uint8_t *, void *, int64_t);

/* Each decoder twice, for f32 and for bf16 output, so neither tests the output type per vector */
#define TWO_WAYS(name)                                                                                              \
    static void name##_f32(const uint8_t *x, void *y, int64_t n) { name(x, y, n, 0); }                           \
    static void name##_bf16(const uint8_t *x, void *y, int64_t n) { name(x, y, n, 1); }
TWO_WAYS(q4_0)
TWO_WAYS(q8_0)
TWO_WAYS(q4_k)
TWO_WAYS(q5_k)
TWO_WAYS(q6_k)

/* the types decoded here, by ggml type id (ggml.h's enum ggml_type, gguf's GGMLQuantizationType) */
static const struct { int ggml_type; decoder f32, bf16; int type_size, block_size; } TYPES[] = {
    {2, q4_0_f32, q4_0_bf16, 18, 32},     {8, q8_0_f32, q8_0_bf16, 34, 32},      {12, q4_k_f32, q4_k_bf16, 144, QK_K},
    {13, q5_k_f32, q5_k_bf16, 176, QK_K}, {14, q6_k_f32, q6_k_bf16, 210, QK_K},
};
#define N_TYPES (int)(sizeof(TYPES) / sizeof(TYPES[0]))

int ggtorch_dequantize(int ggml_type, const uint8_t *src, void *dst, int64_t n_blocks, int threads, int bf16) {
    int t = 0;
    while (t < N_TYPES && TYPES[t].ggml_type != ggml_type) ++t;
    if (t == N_TYPES) return -1;
    const decoder fn = bf16 ? TYPES[t].bf16 : TYPES[t].f32;
    const int64_t type_size = TYPES[t].type_size, block_size = TYPES[t].block_size;
    const int64_t value_size = bf16 ? 2 : 4;
    if (threads < 1 || n_blocks < 2 * threads) threads = 1;
    const int64_t per = n_blocks / threads, extra = n_blocks % threads;
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(static, 1)
#endif
    for (int k = 0; k < threads; ++k) {
        const int64_t b0 = k * per + (k < extra ? k : extra);
        fn(src + b0 * type_size, (uint8_t *)dst + b0 * block_size * value_size, per + (k < extra));
    }
    return 0;
}

int ggtorch_native_types(int *out, int capacity) {
    for (int t = 0; t < N_TYPES && t < capacity; ++t) out[t] = TYPES[t].ggml_type;
    return N_TYPES;
}
