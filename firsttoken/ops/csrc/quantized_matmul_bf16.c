/* int4 and int8 projections for decode-sized steps on AVX512-BF16, bf16 in and out.
 *
 * int4 weights: groups of INT4_GROUP_SIZE inputs, w = (level - 8) * scale + zero (PyTorch's
 * convention), levels 0..15 packed two per byte (byte j of a group: level j low, level j + 16
 * high), bf16 scales and zeros. x . w = sum over groups of scale * (levels . x) + (zero - 8
 * scale) * sum(x): the levels become bf16 128 + level by one OR of their bits and meet x in
 * VDPBF16PS two groups at a time (exact products, float32 sums), the extra 128 folded into
 * the offsets. The decode step (decode_step.c) runs its projections through the same code.
 *
 * int8 weights with per-row scales: the quantized LM head.
 */
#include "decode_kernels.h"

#if VECTOR_BF16
_Static_assert(DECODE_MAX_ROWS == 8, "DISPATCH_ROWS has a case for each row count 1 to 8");
_Static_assert(INT4_INPUT_MULTIPLE == 2 * INT4_GROUP_SIZE, "pair_levels reads two groups at a time");
_Static_assert(INT4_GROUP_SIZE == 32, "a group's levels are 16 bytes, its inputs two registers of bf16");
_Static_assert(INT8_INPUT_MULTIPLE == 16, "int8_block widens 16 weights to one register");

/* BLOCK(n) with n the compile-time constant equal to `rows` (1 to DECODE_MAX_ROWS), so that
 * a kernel's per-row accumulators stay in registers. */
#define DISPATCH_ROWS(rows, BLOCK) \
    switch (rows) { \
    case 1: BLOCK(1); break; \
    case 2: BLOCK(2); break; \
    case 3: BLOCK(3); break; \
    case 4: BLOCK(4); break; \
    case 5: BLOCK(5); break; \
    case 6: BLOCK(6); break; \
    case 7: BLOCK(7); break; \
    case 8: BLOCK(8); break; \
    }

/* Two groups' levels as bf16 128 + level (0x4300 is 128.0 and a level fits its mantissa):
 * `low` holds levels 0-15 of both groups, `high` levels 16-31, the first group in lanes 0-15. */
static inline void pair_levels(const uint8_t *packed, __m512bh *low, __m512bh *high) {
    __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)packed));
    __m512i bias = _mm512_set1_epi16(0x4300);
    /* (bytes & 0x0f) | 0x4300 in one ternary-logic op */
    *low = (__m512bh)_mm512_ternarylogic_epi32(bytes, _mm512_set1_epi16(0x0f), bias, 0xea);
    *high = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(bytes, 4), bias);
}

/* Per row of x: x with the middle quarters of every 64 inputs swapped, so that lanes line
 * up with `pair_levels` (inputs 0-15 of both groups, then 16-31 of both), and the sum of each
 * group of 32 inputs, the term the offsets multiply. in_features is a multiple of 64. */
FT_INTERNAL void prepare_inputs(const uint16_t *x, int64_t rows, int64_t in_features, uint16_t *paired, float *sums) {
    int64_t groups = in_features / INT4_GROUP_SIZE;
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *row = x + r * in_features;
        uint16_t *destination = paired + r * in_features;
        for (int64_t i = 0; i < in_features; i += 2 * INT4_GROUP_SIZE) {
            memcpy(destination + i, row + i, 32);
            memcpy(destination + i + 16, row + i + 32, 32);
            memcpy(destination + i + 32, row + i + 16, 32);
            memcpy(destination + i + 48, row + i + 48, 32);
        }
        for (int64_t g = 0; g < groups; g++) {
            const uint16_t *group = row + g * INT4_GROUP_SIZE;
            __m512 total = _mm512_add_ps(load16_bf16(group, 0xffff), load16_bf16(group + 16, 0xffff));
            sums[r * groups + g] = _mm512_reduce_add_ps(total);
        }
    }
}

/* out[r, o] for o in [begin, end): `rows` is a compile-time constant at each call site, so
 * the accumulators stay in registers. The levels enter as 128 + level, so each group's
 * offset (zero - 8 scale) loses another 128 scales. */
static inline __attribute__((always_inline)) void int4_block(const Int4Weight *w, const uint16_t *paired,
                                                              const float *sums, const int64_t rows, int64_t begin,
                                                              int64_t end, float *row_scales, uint16_t *out) {
    int64_t in_features = w->in_features, groups = in_features / INT4_GROUP_SIZE;
    float *offsets = row_scales + groups;
    for (int64_t o = begin; o < end; o++) {
        const uint16_t *scales_zeros = w->scales_zeros + o * 2 * groups;
        for (int64_t g = 0; g < groups; g += 16) {
            __mmask16 lanes = tail_mask(groups - g);
            __m512 scale = load16_bf16(scales_zeros + g, lanes);
            __m512 zero = load16_bf16(scales_zeros + groups + g, lanes);
            _mm512_mask_storeu_ps(row_scales + g, lanes, scale);
            _mm512_mask_storeu_ps(offsets + g, lanes, _mm512_fnmadd_ps(_mm512_set1_ps(136.0f), scale, zero));
        }
        const uint8_t *levels = w->levels + o * (in_features / 2);
        __m512 totals[DECODE_MAX_ROWS];
        for (int64_t r = 0; r < rows; r++) {
            totals[r] = _mm512_setzero_ps();
        }
        for (int64_t g = 0; g < groups; g += 2) {
            __m512bh low, high;
            pair_levels(levels + g * (INT4_GROUP_SIZE / 2), &low, &high);
            __m512 scale = _mm512_mask_broadcastss_ps(_mm512_set1_ps(row_scales[g]), 0xff00,
                                                      _mm_load_ss(row_scales + g + 1));
            for (int64_t r = 0; r < rows; r++) {
                const uint16_t *inputs = paired + r * in_features + g * INT4_GROUP_SIZE;
                __m512 product = _mm512_dpbf16_ps(_mm512_setzero_ps(), low, (__m512bh)_mm512_loadu_si512(inputs));
                product = _mm512_dpbf16_ps(product, high, (__m512bh)_mm512_loadu_si512(inputs + 32));
                totals[r] = _mm512_fmadd_ps(product, scale, totals[r]);
            }
        }
        for (int64_t r = 0; r < rows; r++) {
            __m512 offset_terms = _mm512_setzero_ps();
            for (int64_t g = 0; g < groups; g += 16) {
                __mmask16 lanes = tail_mask(groups - g);
                offset_terms = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(lanes, offsets + g),
                                               _mm512_maskz_loadu_ps(lanes, sums + r * groups + g), offset_terms);
            }
            float value = bf16_to_float(float_to_bf16(_mm512_reduce_add_ps(_mm512_add_ps(totals[r], offset_terms))));
            if (w->bias != NULL) {
                value += bf16_to_float(((const uint16_t *)w->bias)[o]);
            }
            out[r * w->out_features + o] = float_to_bf16(value);
        }
    }
}

/* This thread's share of out [rows, out_features] = x [rows, in_features] . W^T (bf16),
 * rows <= DECODE_MAX_ROWS; `paired` and `sums` from prepare_inputs; `row_scales` scratch of
 * 2 * groups floats. */
FT_INTERNAL void int4_share(const Int4Weight *w, const uint16_t *paired, const float *sums, int64_t rows,
                       float *row_scales, uint16_t *out) {
    int64_t begin, end;
    thread_rows(w->out_features, &begin, &end);
#define INT4_BLOCK(n) int4_block(w, paired, sums, n, begin, end, row_scales, out)
    DISPATCH_ROWS(rows, INT4_BLOCK)
#undef INT4_BLOCK
}

/* out = x . W^T for x contiguous bf16 [rows, in_features], rows <= DECODE_MAX_ROWS,
 * in_features a multiple of 64, out contiguous bf16 [rows, out_features]. Returns FT_OUT_OF_MEMORY
 * when out of memory. */
FtStatus ft_int4_matmul(const uint8_t *levels, const uint16_t *scales_zeros, const uint16_t *bias, int64_t out_features,
                        int64_t in_features, const uint16_t *x, int64_t rows, uint16_t *out, int num_threads) {
    Int4Weight weight = {levels, scales_zeros, bias, out_features, in_features};
    int64_t groups = in_features / INT4_GROUP_SIZE;
    float *sums = malloc((size_t)(rows * groups) * sizeof(float) + (size_t)(rows * in_features) * sizeof(uint16_t));
    if (sums == NULL) {
        return FT_OUT_OF_MEMORY;
    }
    uint16_t *paired = (uint16_t *)(sums + rows * groups);
    prepare_inputs(x, rows, in_features, paired, sums);
    int succeeded = 1;
#pragma omp parallel num_threads(num_threads) if (out_features * in_features >= 4 * PARALLEL_MIN_ELEMENTS) \
    reduction(&& : succeeded)
    {
        float *row_scales = malloc((size_t)(2 * groups) * sizeof(float));
        succeeded = row_scales != NULL;
        if (succeeded) {
            int4_share(&weight, paired, sums, rows, row_scales, out);
        }
        free(row_scales);
    }
    free(sums);
    return succeeded ? FT_OK : FT_OUT_OF_MEMORY;
}

/* out[r, o] = scale[o] * (x[r] . W[o]) for int8 W [out, in] (in a multiple of 16), x
 * contiguous bf16 [rows <= DECODE_MAX_ROWS, in], bf16 scales, out bf16 [rows, out]; `inputs`
 * holds x in float32. `rows` is a compile-time constant at each call site. */
static inline __attribute__((always_inline)) void int8_block(const int8_t *weight, const uint16_t *scales,
                                                              const uint16_t *bias, int64_t out_features,
                                                              int64_t in_features, const float *inputs,
                                                              const int64_t rows, int64_t begin, int64_t end,
                                                              uint16_t *out) {
    for (int64_t o = begin; o < end; o++) {
        const int8_t *row = weight + o * in_features;
        __m512 totals[DECODE_MAX_ROWS];
        for (int64_t r = 0; r < rows; r++) {
            totals[r] = _mm512_setzero_ps();
        }
        for (int64_t i = 0; i < in_features; i += 16) {
            __m512 weights = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + i))));
            for (int64_t r = 0; r < rows; r++) {
                totals[r] = _mm512_fmadd_ps(weights, _mm512_loadu_ps(inputs + r * in_features + i), totals[r]);
            }
        }
        float scale = bf16_to_float(scales[o]);
        for (int64_t r = 0; r < rows; r++) {
            float value = bf16_to_float(float_to_bf16(_mm512_reduce_add_ps(totals[r]) * scale));
            if (bias != NULL) {
                value += bf16_to_float(bias[o]);
            }
            out[r * out_features + o] = float_to_bf16(value);
        }
    }
}

/* out = x . (scales * W)^T for int8 W: see int8_block. Returns FT_OUT_OF_MEMORY when out of memory. */
FtStatus ft_int8_matmul(const int8_t *weight, const uint16_t *scales, const uint16_t *bias, int64_t out_features,
                        int64_t in_features, const uint16_t *x, int64_t rows, uint16_t *out, int num_threads) {
    float *inputs = malloc((size_t)(rows * in_features) * sizeof(float));
    if (inputs == NULL) {
        return FT_OUT_OF_MEMORY;
    }
    load_row(x, 0, rows * in_features, DTYPE_BFLOAT16, inputs);
#pragma omp parallel num_threads(num_threads) if (out_features * in_features >= 4 * PARALLEL_MIN_ELEMENTS)
    {
        int64_t begin, end;
        thread_rows(out_features, &begin, &end);
#define INT8_BLOCK(n) int8_block(weight, scales, bias, out_features, in_features, inputs, n, begin, end, out)
        DISPATCH_ROWS(rows, INT8_BLOCK)
#undef INT8_BLOCK
    }
    free(inputs);
    return FT_OK;
}
#endif
