/* The ISA layer of the portable kernels: one float vector type and the few operations they
 * need, over GCC's vector extensions, so one kernel source builds for every CPU class.
 *
 * The vector is as wide as the widest float registers the build targets: 16 floats with
 * AVX-512F, 8 with AVX (AVX2 + FMA), 4 elsewhere (SSE2, NEON). The compiler maps each
 * operation to that ISA's instructions (a * b + c to an FMA where the target has one).
 * Loads and stores go through memcpy, which compiles to one unaligned vector move. Which variant a build holds is `ft_isa_name()` in row_kernels.c.
 *
 * Every function here works lane by lane, except the two reductions, whose lane order is
 * fixed: a result never depends on anything but its own inputs.
 */
#ifndef FIRSTTOKEN_ISA_H
#define FIRSTTOKEN_ISA_H

/* The build is ISO C (-std=c11), where GCC never fuses a * b + c; with FMA units that fusion
 * is the whole point here. A source including this header therefore starts with
 * `#pragma GCC optimize("fp-contract=fast")`, before any include: GCC inlines a function only
 * into functions built with the same options, so the pragma must cover common.h's helpers too
 * (after them, every bf16 conversion and row load would be a call). */

#include <stdint.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
#define VEC_WIDTH 16
#elif defined(__AVX__)
#define VEC_WIDTH 8
#else
#define VEC_WIDTH 4
#endif

typedef float vfloat __attribute__((vector_size(VEC_WIDTH * sizeof(float))));
typedef int32_t vint __attribute__((vector_size(VEC_WIDTH * sizeof(int32_t))));
typedef uint32_t vuint __attribute__((vector_size(VEC_WIDTH * sizeof(uint32_t))));
typedef uint16_t vbf16 __attribute__((vector_size(VEC_WIDTH * sizeof(uint16_t))));
typedef uint8_t vbyte __attribute__((vector_size(VEC_WIDTH * sizeof(uint8_t))));

static inline vfloat vf_splat(float value) {
    return (vfloat){0} + value;
}

static inline vfloat vf_load(const float *source) {
    vfloat v;
    memcpy(&v, source, sizeof v);
    return v;
}

static inline void vf_store(float *destination, vfloat v) {
    memcpy(destination, &v, sizeof v);
}

/* VEC_WIDTH bf16 values (raw bits) widened to float32: exact. */
static inline vfloat vf_load_bf16(const uint16_t *source) {
#if defined(__AVX512F__)
    /* One widening load: GCC makes the generic conversion below two halves and an insert. */
    return (vfloat)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)source)), 16);
#else
    vbf16 bits;
    memcpy(&bits, source, sizeof bits);
    vuint widened = __builtin_convertvector(bits, vuint) << 16;
    return (vfloat)widened;
#endif
}

/* The bf16 bits of each lane rounded to nearest even, as torch rounds; NaN stays a quiet NaN. */
static inline vuint vf_bf16_bits(vfloat v) {
    vuint bits = (vuint)v;
    vuint is_nan = (vuint)((bits & 0x7fffffffu) > 0x7f800000u);
    vuint rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    vuint quiet_nan = (bits >> 16) | 0x40u;
    return (rounded & ~is_nan) | (quiet_nan & is_nan);
}

/* Rounded to bf16 (vf_bf16_bits) and stored. */
static inline void vf_store_bf16(uint16_t *destination, vfloat v) {
    vbf16 narrowed = __builtin_convertvector(vf_bf16_bits(v), vbf16);
    memcpy(destination, &narrowed, sizeof narrowed);
}

/* Each lane rounded to bf16's values (vf_bf16_bits), kept in float32. */
static inline vfloat vf_round_bf16(vfloat v) {
    return (vfloat)(vf_bf16_bits(v) << 16);
}

/* Each lane rounded to bf16's values, kept in float32, as common.h's round_row rounds: with
 * AVX512-BF16 by its conversion instruction (a denormal flushes to zero), else vf_round_bf16. */
static inline vfloat round_lanes_bf16(vfloat v) {
#if VECTOR_BF16
    return (vfloat)_mm512_slli_epi32(_mm512_cvtepu16_epi32(round16_bf16((__m512)v)), 16);
#else
    return vf_round_bf16(v);
#endif
}

/* Loads VEC_WIDTH values stored in `dtype` (DTYPE_FLOAT32 or DTYPE_BFLOAT16) at `index`. */
static inline vfloat vf_load_as(const void *source, int64_t index, int is_bf16) {
    return is_bf16 ? vf_load_bf16((const uint16_t *)source + index) : vf_load((const float *)source + index);
}

/* a * b + c, lane by lane, rounded once where the target has FMA (by the instruction itself:
 * GCC's contraction of a * b + c depends on the code around it, as its Zen tuning leaves some
 * accumulation chains unfused, so two bodies of one chain could round differently). */
static inline vfloat vf_fma(vfloat a, vfloat b, vfloat c) {
#if defined(__AVX512F__)
    return (vfloat)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__) && VEC_WIDTH == 8
    return (vfloat)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    return a * b + c;
#endif
}

/* Lane by lane: `when_true` where `mask` is all ones, else `when_false`. */
static inline vfloat vf_select(vint mask, vfloat when_true, vfloat when_false) {
    return (vfloat)(((vint)when_true & mask) | ((vint)when_false & ~mask));
}

/* a > b ? a : b, lane by lane: x86's MAXPS is exactly that (b where either is NaN or both are
 * zeros), one instruction where GCC builds the select from three. */
static inline vfloat vf_max(vfloat a, vfloat b) {
#if defined(__AVX512F__)
    return (vfloat)_mm512_max_ps((__m512)a, (__m512)b);
#elif defined(__AVX__)
    return (vfloat)_mm256_max_ps((__m256)a, (__m256)b);
#else
    return vf_select(a > b, a, b);
#endif
}

/* a < b ? a : b, lane by lane (MINPS, likewise). */
static inline vfloat vf_min(vfloat a, vfloat b) {
#if defined(__AVX512F__)
    return (vfloat)_mm512_min_ps((__m512)a, (__m512)b);
#elif defined(__AVX__)
    return (vfloat)_mm256_min_ps((__m256)a, (__m256)b);
#else
    return vf_select(a < b, a, b);
#endif
}

/* Lanes added in a fixed tree order. */
static inline float vf_sum(vfloat v) {
    float lanes[VEC_WIDTH];
    vf_store(lanes, v);
    for (int width = VEC_WIDTH / 2; width >= 1; width /= 2) {
        for (int lane = 0; lane < width; lane++) {
            lanes[lane] += lanes[lane + width];
        }
    }
    return lanes[0];
}

static inline float vf_max_lane(vfloat v) {
    float lanes[VEC_WIDTH];
    vf_store(lanes, v);
    float best = lanes[0];
    for (int lane = 1; lane < VEC_WIDTH; lane++) {
        best = lanes[lane] > best ? lanes[lane] : best;
    }
    return best;
}

/* e^x: 2^n * e^r with |r| <= ln2 / 2, e^r by its degree-6 Taylor polynomial (relative error
 * ~2e-7); inputs below -87 give 0 or a tiny denormal-free value, as softmax needs. */
static inline vfloat vf_exp(vfloat x) {
    x = vf_max(x, vf_splat(-87.0f));
    x = vf_min(x, vf_splat(88.0f));
    /* n = x log2(e) rounded half away from zero, by conversions: the build's
     * -fassociative-math folds the add-and-subtract-1.5*2^23 rounding trick away. */
    vfloat scaled = x * 1.44269504f;
    vint whole = __builtin_convertvector(scaled + vf_select(scaled < 0.0f, vf_splat(-0.5f), vf_splat(0.5f)), vint);
    vfloat n = __builtin_convertvector(whole, vfloat);
    vfloat r = x - n * 0.693145752f;
    r = r - n * 1.42860677e-06f;
    vfloat p = vf_splat(1.0f / 720.0f);
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    vint exponent = (whole + 127) << 23;
    return p * (vfloat)exponent;
}

/* tanh(x) as 1 - 2 / (e^(2x) + 1): +-1 where vf_exp clamps; absolute error ~1e-7 near 0. */
static inline vfloat vf_tanh(vfloat x) {
    return vf_splat(1.0f) - vf_splat(2.0f) / (vf_exp(x + x) + vf_splat(1.0f));
}

/* ---- Added for the attention kernels (csrc/attention.c). ---- */

/* Lane indices 0, 1, ..., VEC_WIDTH - 1. */
static inline vint vi_lane_indices(void) {
    vint indices;
    for (int lane = 0; lane < VEC_WIDTH; lane++) {
        indices[lane] = lane;
    }
    return indices;
}

/* One level of vf_sums: lanes of a and b picked by the `even` and `odd` index masks, added. */
#define VF_PAIR_SUM(a, b, even, odd) (__builtin_shuffle((a), (b), (even)) + __builtin_shuffle((a), (b), (odd)))

/* Lane i of the result is the sum of the lanes of v[i], for VEC_WIDTH vectors at once (a
 * transpose as it adds). Each sum is a fixed tree: neighbours in each group of four lanes,
 * twice (one SHUFPS each), then halves of 128-bit blocks. Overwrites `v`. */
static inline vfloat vf_sums(vfloat v[VEC_WIDTH]) {
#if VEC_WIDTH == 16
    const vint even = {0, 2, 16, 18, 4, 6, 20, 22, 8, 10, 24, 26, 12, 14, 28, 30};
    const vint even_blocks = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
#elif VEC_WIDTH == 8
    const vint even = {0, 2, 8, 10, 4, 6, 12, 14};
    const vint even_blocks = {0, 1, 2, 3, 8, 9, 10, 11};
#else
    const vint even = {0, 2, 4, 6};
#endif
    const vint odd = even + 1;
    int count = VEC_WIDTH;
    for (int level = 0; level < 2; level++, count /= 2) {
        for (int i = 0; i < count / 2; i++) {
            v[i] = VF_PAIR_SUM(v[2 * i], v[2 * i + 1], even, odd);
        }
    }
#if VEC_WIDTH > 4
    const vint odd_blocks = even_blocks + 4;
    for (; count > 1; count /= 2) {
        for (int i = 0; i < count / 2; i++) {
            v[i] = VF_PAIR_SUM(v[2 * i], v[2 * i + 1], even_blocks, odd_blocks);
        }
    }
#endif
    return v[0];
}

/* ---- Byte loads for quantized weights (quantized_matmul.c) ---- */

/* VEC_WIDTH bytes widened to 32-bit lanes, unsigned or signed. GCC's __builtin_convertvector
 * from a byte vector extracts byte by byte; the x86 builds use one widening load instead. */
static inline vint vi_load_u8(const uint8_t *source) {
#if defined(__AVX512F__)
    return (vint)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)source));
#elif defined(__AVX2__)
    return (vint)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)source));
#else
    vbyte bytes;
    memcpy(&bytes, source, sizeof bytes);
    return __builtin_convertvector(bytes, vint);
#endif
}

static inline vint vi_load_i8(const int8_t *source) {
#if defined(__AVX512F__)
    return (vint)_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)source));
#elif defined(__AVX2__)
    return (vint)_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)source));
#else
    typedef int8_t vsbyte __attribute__((vector_size(VEC_WIDTH)));
    vsbyte bytes;
    memcpy(&bytes, source, sizeof bytes);
    return __builtin_convertvector(bytes, vint);
#endif
}

/* Each lane rounded to the nearest integer, ties to even (the default rounding mode), as
 * torch.round; lanes must lie within int32. GCC does not vectorize nearbyintf here. */
static inline vint vi_round_even(vfloat v) {
#if defined(__AVX512F__)
    return (vint)_mm512_cvtps_epi32((__m512)v);
#elif defined(__AVX2__)
    return (vint)_mm256_cvtps_epi32((__m256)v);
#else
    float lanes[VEC_WIDTH];
    vint rounded;
    vf_store(lanes, v);
    for (int lane = 0; lane < VEC_WIDTH; lane++) {
        rounded[lane] = (int32_t)nearbyintf(lanes[lane]);
    }
    return rounded;
#endif
}

#endif
