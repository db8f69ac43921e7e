/* What ggtorch's C loops share: 16-wide f32 vectors (GCC/Clang vector extensions, compiled to AVX-512, AVX2,
 * NEON or scalar code, whatever the target has), their loads and stores in f32 and bf16, and the scalar
 * conversions. bf16 is widened exactly on load and rounded to nearest even on store, NaN kept quiet, as
 * torch's f32 -> bf16 conversion rounds; a lane-wise select and e^x; the size of a loop's team. Included by
 * ops/lowrank.c, ops/fused.c, ops/attention.c and quant/native.c; ops/clib.py hashes it into each library's
 * cache key. */
#ifndef GGTORCH_VEC_H
#define GGTORCH_VEC_H

#include <stdint.h>
#include <string.h>

#define L 16 /* lanes of a vector */

typedef float v16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint16_t u16x32 __attribute__((vector_size(64)));

static inline v16 ld_f32(const float *p) {
    v16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void st_f32(float *p, v16 v) { memcpy(p, &v, sizeof v); }

#if (defined(__clang__) || __GNUC__ >= 12) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#define GGTORCH_SHUFFLES 1 /* __builtin_shufflevector is there */
#endif

/* bf16 -> f32: a bf16 is the high half of its f32, put there by one 16-bit lane shuffle (or, without shuffles, a
 * widening conversion and a shift) */
static inline v16 ld_bf16(const uint16_t *p) {
    u16x16 h;
    memcpy(&h, p, sizeof h);
#ifdef GGTORCH_SHUFFLES
    const u16x32 w = __builtin_shufflevector(h, (u16x16){0}, 16, 0, 16, 1, 16, 2, 16, 3, 16, 4, 16, 5, 16, 6, 16, 7,
                                             16, 8, 16, 9, 16, 10, 16, 11, 16, 12, 16, 13, 16, 14, 16, 15);
#else
    const u32x16 w = __builtin_convertvector(h, u32x16) << 16;
#endif
    v16 v;
    memcpy(&v, &w, sizeof v);
    return v;
}

/* f32 -> bf16 in the high half of each lane: the bits rounded to nearest even, NaN made quiet */
static inline u32x16 bf16_bits(v16 v) {
    u32x16 b;
    memcpy(&b, &v, sizeof b);
    const u32x16 nan = (u32x16)(v != v);
    return ((b | 0x00400000u) & nan) | ((b + 0x7fffu + ((b >> 16) & 1u)) & ~nan);
}

/* bf16_bits for lanes that hold no NaN (the caller knows): the rounding alone */
static inline u32x16 bf16_bits_of_numbers(v16 v) {
    u32x16 b;
    memcpy(&b, &v, sizeof b);
    return b + 0x7fffu + ((b >> 16) & 1u);
}

/* The high halves of the lanes of r, as 16 bf16 values at p (one lane shuffle, or without shuffles a shift and
 * a narrowing conversion) */
static inline void st_high_halves(uint16_t *p, u32x16 r) {
#ifdef GGTORCH_SHUFFLES
    u16x32 w;
    memcpy(&w, &r, sizeof w);
    const u16x16 h = __builtin_shufflevector(w, w, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
#else
    const u16x16 h = __builtin_convertvector(r >> 16, u16x16);
#endif
    memcpy(p, &h, sizeof h);
}

/* f32 -> bf16 at p: the high halves of the rounded bits */
static inline void st_bf16(uint16_t *p, v16 v) { st_high_halves(p, bf16_bits(v)); }

static inline float f32_of_f32(const float *p) { return *p; }

static inline float f32_of_bf16(const uint16_t *p) {
    const uint32_t w = (uint32_t)*p << 16;
    float f;
    memcpy(&f, &w, 4);
    return f;
}

static inline uint16_t bf16_of(float f) {
    uint32_t b;
    memcpy(&b, &f, 4);
    return (b & 0x7fffffffu) > 0x7f800000u ? (uint16_t)((b >> 16) | 0x40u)
                                           : (uint16_t)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}

static inline void set_f32(float *p, float f) { *p = f; }

static inline void set_bf16(uint16_t *p, float f) { *p = bf16_of(f); }

/* f in every lane: a broadcast (0 + f would cost an add, which -0 keeps the compiler from dropping) */
static inline v16 splat(float f) { return (v16){f, f, f, f, f, f, f, f, f, f, f, f, f, f, f, f}; }

static inline v16 vselect(i32x16 mask, v16 a, v16 b) { /* mask ? a : b, lane by lane */
    return (v16)(((i32x16)a & mask) | ((i32x16)b & ~mask));
}

/* e^x, lane by lane: Cephes' expf (n = round(x / ln 2), e^r on |r| <= ln 2 / 2 as a degree-7 polynomial,
 * times 2^n through the exponent bits), within 2 ulp of e^x for x in [-87, 88]; x is clamped to that range
 * (the exact result then is below 2^-125 or above 2^126, and silu or the sigmoid of such an x differs
 * from the one of the range's end by less than one f32 step of either). NaN stays NaN. */
static inline v16 vexp(v16 x) {
    const v16 lo = splat(-87.f), hi = splat(88.f);
    x = vselect((i32x16)(x < lo), lo, x);
    x = vselect((i32x16)(x > hi), hi, x);
    const v16 magic = splat(12582912.f); /* 1.5 * 2^23: adding it rounds to an integer in the low bits */
    const v16 t = x * 1.44269504088896341f + magic;
    const v16 n = t - magic;
    const v16 r = x - n * 0.693359375f - n * -2.12194440e-4f;
    v16 p = splat(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const v16 e = p * (r * r) + r + 1.f;
    const i32x16 bits = ((i32x16)t - (i32x16)magic + 127) << 23;
    return e * (v16)bits;
}

/* e^x, and 0 where x < -87 (where vexp clamps; e^x is below f32's normals there) */
static inline v16 vexp_or_0(v16 x) { return vselect((i32x16)(x < splat(-87.f)), splat(0.f), vexp(x)); }

/* Threads for a parallel loop over `units` tasks: 1 below `min_work` (waking the team costs more than the work),
 * else torch's count, at most one per task. */
static inline int team(int threads, int64_t work, int64_t min_work, int64_t units) {
    if (threads < 1 || work < min_work) return 1;
    return units < threads ? (int)(units > 0 ? units : 1) : threads;
}

/* A parallel loop on `nt` threads of the team (see team). */
#ifdef _OPENMP
#define PARALLEL_FOR _Pragma("omp parallel for num_threads(nt) schedule(static)")
#else
#define PARALLEL_FOR
#endif

#endif
