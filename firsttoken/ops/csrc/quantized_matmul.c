/* int4 and int8 projections for decode-sized steps on every ISA (through isa.h): float32 or
 * bf16 activations, float32 arithmetic, output in the activation dtype.
 *
 * A decode step is bound by reading the weights, so each weight byte is read once per call:
 * a group of 32 int4 weights (or VEC_WIDTH int8 ones) is widened to float32 in registers once
 * and meets every row of the step there. With one to three rows that leaves too few
 * independent sums to hide the FMA latency, so such calls work on two or four outputs at a
 * time; an output's arithmetic is the same whatever the tile and the row count.
 *
 * int4 weights are never dequantized: with w = (level - 8) * scale + zero, a row's output is
 * sum_g scale_g * (levels_g . x_g) + sum_g (zero_g - 8 * scale_g) * sum(x_g), so a group costs
 * its level conversions, one FMA per input vector and row and one per row for its scale (the
 * zero terms are a short dot per output). Where the CPU is short of
 * vector throughput (AVX2 on Zen 1 splits each 256-bit op in two) this is what bounds a
 * one-row step: 1.4x faster than dequantizing each group first, and about as fast at 2 to 8 rows
 * (120 SmolLM2-135M projections on one Zen 1 core).
 *
 * Each (row, output) sum runs in one fixed order: per group (int4) or per VEC_WIDTH inputs
 * (int8), lane by lane into one vector accumulator, then vf_sum. A row's result depends on its
 * own inputs only, never on the other rows of the call nor on the thread count.
 *
 * int4 layout (firsttoken/ops/quantized_linear.py pack_int4): levels uint8 [out, in / 2], byte j of each
 * group of 32 holds level j (low nibble) and level j + 16 (high nibble); bf16 scales_zeros
 * [out, 2 * groups], a row's group scales then its zeros.
 */
/* The build allows reassociation for the other kernels; here it could regroup a sum
 * differently in the code for each row count, and a row's bits would follow the batch. Set
 * before any function, with isa.h's FMA contraction: GCC inlines a function only into one
 * built with the same options, and every call here must inline. */
#pragma GCC optimize("no-associative-math", "fp-contract=fast")
#include "decode_kernels.h"
#include "isa.h"

/* float vectors in a group of INT4_GROUP_SIZE int4 weights: half of them from the low nibbles. */
#define GROUP_VECTORS (INT4_GROUP_SIZE / VEC_WIDTH)
#define MAX_TILE 4
_Static_assert(DECODE_MAX_ROWS == 8, "DISPATCH_QUANTIZED_ROWS has a case for each row count 1 to 8");

/* Outputs worked on together for `rows` rows: enough independent sums to keep the FMA units busy. */
#define TILE_FOR(rows) ((rows) == 1 ? 4 : (rows) <= 3 ? 2 : 1)

/* BLOCK(n, tile) with n the compile-time constant equal to `rows`, so the accumulators stay in
 * registers. */
#define DISPATCH_QUANTIZED_ROWS(rows, BLOCK) \
    switch (rows) { \
    case 1: BLOCK(1, TILE_FOR(1)); break; \
    case 2: BLOCK(2, TILE_FOR(2)); break; \
    case 3: BLOCK(3, TILE_FOR(3)); break; \
    case 4: BLOCK(4, TILE_FOR(4)); break; \
    case 5: BLOCK(5, TILE_FOR(5)); break; \
    case 6: BLOCK(6, TILE_FOR(6)); break; \
    case 7: BLOCK(7, TILE_FOR(7)); break; \
    case 8: BLOCK(8, TILE_FOR(8)); break; \
    }

/* x (rows * in_features elements in `dtype`) as float32: `x` itself, or widened into `scratch`. */
static const float *float_inputs(const void *x, int64_t count, int dtype, float *scratch) {
    if (dtype != DTYPE_BFLOAT16) {
        return (const float *)x;
    }
    for (int64_t i = 0; i < count; i += VEC_WIDTH) {
        vf_store(scratch + i, vf_load_bf16((const uint16_t *)x + i));
    }
    return scratch;
}

/* Stores a row's float32 sum as the activation dtype would hold it, then adds the bias (in
 * that dtype), rounding again: torch's order for a matmul followed by `+ bias`. */
static inline void store_output(float sum, const void *bias, int64_t o, int dtype, void *out, int64_t index) {
    float value = round_to(sum, dtype);
    if (bias != NULL) {
        value += dtype == DTYPE_BFLOAT16 ? bf16_to_float(((const uint16_t *)bias)[o]) : ((const float *)bias)[o];
    }
    if (dtype == DTYPE_BFLOAT16) {
        ((uint16_t *)out)[index] = float_to_bf16(value);
    } else {
        ((float *)out)[index] = value;
    }
}

/* One group's 32 levels (0-15) as float32, in input order: vectors [0, GROUP_VECTORS / 2) from
 * the low nibbles (levels of inputs 0-15), the rest from the high ones (inputs 16-31). */
static inline void group_levels(const uint8_t *packed, vfloat *levels) {
    for (int c = 0; c < GROUP_VECTORS / 2; c++) {
        vint bytes = vi_load_u8(packed + c * VEC_WIDTH);
        levels[c] = __builtin_convertvector(bytes & 15, vfloat);
        levels[c + GROUP_VECTORS / 2] = __builtin_convertvector(bytes >> 4, vfloat);
    }
}

/* sum_i levels_i * inputs_i over one group, lane by lane, in input order. */
static inline vfloat group_dot(const vfloat *levels, const float *inputs) {
    vfloat dot = levels[0] * vf_load(inputs);
    for (int c = 1; c < GROUP_VECTORS; c++) {
        dot += levels[c] * vf_load(inputs + c * VEC_WIDTH);
    }
    return dot;
}

FT_INTERNAL void portable_int4_input_sums(const float *x, int64_t rows, int64_t in_features, float *sums) {
    int64_t groups = in_features / INT4_GROUP_SIZE;
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t g = 0; g < groups; g++) {
            const float *inputs = x + r * in_features + g * INT4_GROUP_SIZE;
            vfloat total = vf_load(inputs);
            for (int c = 1; c < GROUP_VECTORS; c++) {
                total += vf_load(inputs + c * VEC_WIDTH);
            }
            sums[r * groups + g] = vf_sum(total);
        }
    }
}

/* zero_g - 8 * scale_g for VEC_WIDTH groups from g: the part of each weight that does not depend
 * on its level, as w = (level - 8) * scale + zero. */
static inline vfloat group_offsets(const uint16_t *scales_zeros, int64_t groups, int64_t g) {
    return vf_load_bf16(scales_zeros + groups + g) - 8.0f * vf_load_bf16(scales_zeros + g);
}

static inline float group_offset(const uint16_t *scales_zeros, int64_t groups, int64_t g) {
    return bf16_to_float(scales_zeros[groups + g]) - 8.0f * bf16_to_float(scales_zeros[g]);
}

/* Outputs [o, o + tile) for every row; `rows` and `tile` are compile-time constants at each
 * call site. A row's output is sum_g scale_g * (levels_g . x_g), the level dots kept lane by
 * lane, plus the zero term: the levels are widened once per group for all rows, and never
 * scaled. */
static inline __attribute__((always_inline)) void int4_tile(const Int4Weight *w, const float *x,
                                                             const float *input_sums, const int64_t rows,
                                                             const int64_t tile, int64_t o, int dtype, void *out) {
    int64_t in_features = w->in_features, groups = in_features / INT4_GROUP_SIZE;
    vfloat totals[DECODE_MAX_ROWS * MAX_TILE];
    for (int64_t i = 0; i < rows * tile; i++) {
        totals[i] = vf_splat(0.0f);
    }
    for (int64_t g = 0; g < groups; g++) {
        for (int64_t t = 0; t < tile; t++) {
            float scale = bf16_to_float(w->scales_zeros[(o + t) * 2 * groups + g]);
            vfloat levels[GROUP_VECTORS];
            group_levels(w->levels + (o + t) * (in_features / 2) + g * (INT4_GROUP_SIZE / 2), levels);
            for (int64_t r = 0; r < rows; r++) {
                totals[r * tile + t] += group_dot(levels, x + r * in_features + g * INT4_GROUP_SIZE) * scale;
            }
        }
    }
    /* Each row's sum_g offset_g * input_sum_g: lane by lane over whole vectors of groups, added
     * to the level-dot lanes, then the other groups in order after the lanes' sum. */
    int64_t whole_groups = groups - groups % VEC_WIDTH;
    for (int64_t t = 0; t < tile; t++) {
        const uint16_t *scales_zeros = w->scales_zeros + (o + t) * 2 * groups;
        for (int64_t g = 0; g < whole_groups; g += VEC_WIDTH) {
            vfloat offsets = group_offsets(scales_zeros, groups, g);
            for (int64_t r = 0; r < rows; r++) {
                totals[r * tile + t] += offsets * vf_load(input_sums + r * groups + g);
            }
        }
        for (int64_t r = 0; r < rows; r++) {
            float sum = vf_sum(totals[r * tile + t]);
            for (int64_t g = whole_groups; g < groups; g++) {
                sum += group_offset(scales_zeros, groups, g) * input_sums[r * groups + g];
            }
            store_output(sum, w->bias, o + t, dtype, out, r * w->out_features + o + t);
        }
    }
}

/* Outputs [begin, end): whole tiles, then one output at a time. */
static inline __attribute__((always_inline)) void int4_outputs(const Int4Weight *w, const float *x,
                                                                const float *input_sums, const int64_t rows,
                                                                const int64_t tile, int64_t begin, int64_t end,
                                                                int dtype, void *out) {
    int64_t o = begin;
    for (; o + tile <= end; o += tile) {
        int4_tile(w, x, input_sums, rows, tile, o, dtype, out);
    }
    for (; o < end; o++) {
        int4_tile(w, x, input_sums, rows, 1, o, dtype, out);
    }
}

FT_INTERNAL void portable_int4_share(const Int4Weight *w, const float *x, const float *input_sums, int64_t rows,
                                     int dtype, void *out) {
    int64_t begin, end;
    thread_rows(w->out_features, &begin, &end);
#define INT4_BLOCK(n, tile) int4_outputs(w, x, input_sums, n, tile, begin, end, dtype, out)
    DISPATCH_QUANTIZED_ROWS(rows, INT4_BLOCK)
#undef INT4_BLOCK
}

/* out [rows, out_features] = x [rows, in_features] . W^T (+ bias) for 1 <= rows <=
 * DECODE_MAX_ROWS, in_features a multiple of 32; x, bias and out contiguous in `dtype`
 * (DTYPE_FLOAT32 or DTYPE_BFLOAT16). Returns FT_OUT_OF_MEMORY when out of memory. */
FtStatus ft_portable_int4_matmul(const uint8_t *levels, const uint16_t *scales_zeros, const void *bias,
                                 int64_t out_features, int64_t in_features, const void *x, int64_t rows, void *out,
                                 int dtype, int num_threads) {
    Int4Weight weight = {levels, scales_zeros, bias, out_features, in_features};
    int64_t input_count = rows * in_features, groups = in_features / INT4_GROUP_SIZE;
    /* The group input sums, then (bf16 activations) the inputs widened to float32. */
    float *scratch = malloc((size_t)(rows * groups + (dtype == DTYPE_BFLOAT16 ? input_count : 0)) * sizeof(float));
    if (scratch == NULL) {
        return FT_OUT_OF_MEMORY;
    }
    float *input_sums = scratch;
    const float *inputs = float_inputs(x, input_count, dtype, scratch + rows * groups);
    portable_int4_input_sums(inputs, rows, in_features, input_sums);
#pragma omp parallel num_threads(num_threads) if (out_features * in_features >= 4 * PARALLEL_MIN_ELEMENTS)
    portable_int4_share(&weight, inputs, input_sums, rows, dtype, out);
    free(scratch);
    return FT_OK;
}

/* int8 outputs [o, o + tile): out[r, o] = scale[o] * (x[r] . W[o]), scales in `dtype`. */
static inline __attribute__((always_inline)) void int8_tile(const int8_t *weight, const void *scales, const void *bias,
                                                             int64_t out_features, int64_t in_features,
                                                             const float *x, const int64_t rows, const int64_t tile,
                                                             int64_t o, int dtype, void *out) {
    vfloat totals[DECODE_MAX_ROWS * MAX_TILE];
    for (int64_t i = 0; i < rows * tile; i++) {
        totals[i] = vf_splat(0.0f);
    }
    for (int64_t i = 0; i < in_features; i += VEC_WIDTH) {
        for (int64_t t = 0; t < tile; t++) {
            vfloat weights = __builtin_convertvector(vi_load_i8(weight + (o + t) * in_features + i), vfloat);
            for (int64_t r = 0; r < rows; r++) {
                totals[r * tile + t] += weights * vf_load(x + r * in_features + i);
            }
        }
    }
    for (int64_t t = 0; t < tile; t++) {
        float scale = dtype == DTYPE_BFLOAT16 ? bf16_to_float(((const uint16_t *)scales)[o + t])
                                              : ((const float *)scales)[o + t];
        for (int64_t r = 0; r < rows; r++) {
            store_output(vf_sum(totals[r * tile + t]) * scale, bias, o + t, dtype, out, r * out_features + o + t);
        }
    }
}

static inline __attribute__((always_inline)) void int8_outputs(const int8_t *weight, const void *scales,
                                                                const void *bias, int64_t out_features,
                                                                int64_t in_features, const float *x, const int64_t rows,
                                                                const int64_t tile, int64_t begin, int64_t end,
                                                                int dtype, void *out) {
    int64_t o = begin;
    for (; o + tile <= end; o += tile) {
        int8_tile(weight, scales, bias, out_features, in_features, x, rows, tile, o, dtype, out);
    }
    for (; o < end; o++) {
        int8_tile(weight, scales, bias, out_features, in_features, x, rows, 1, o, dtype, out);
    }
}

/* out [rows, out_features] = x . (scales * W)^T (+ bias) for int8 W [out, in], 1 <= rows <=
 * DECODE_MAX_ROWS, in_features a multiple of 16; x, scales [out], bias and out contiguous in
 * `dtype`. Returns FT_OUT_OF_MEMORY when out of memory. */
FtStatus ft_portable_int8_matmul(const int8_t *weight, const void *scales, const void *bias, int64_t out_features,
                                 int64_t in_features, const void *x, int64_t rows, void *out, int dtype,
                                 int num_threads) {
    float *scratch = NULL;
    if (dtype == DTYPE_BFLOAT16 && (scratch = malloc((size_t)(rows * in_features) * sizeof(float))) == NULL) {
        return FT_OUT_OF_MEMORY;
    }
    const float *inputs = float_inputs(x, rows * in_features, dtype, scratch);
#pragma omp parallel num_threads(num_threads) if (out_features * in_features >= 4 * PARALLEL_MIN_ELEMENTS)
    {
        int64_t begin, end;
        thread_rows(out_features, &begin, &end);
#define INT8_BLOCK(n, tile) \
    int8_outputs(weight, scales, bias, out_features, in_features, inputs, n, tile, begin, end, dtype, out)
        DISPATCH_QUANTIZED_ROWS(rows, INT8_BLOCK)
#undef INT8_BLOCK
    }
    free(scratch);
    return FT_OK;
}
