/* int4 and int8 projections for decode-sized steps on every ISA (through isa.h): float32 or
 * bf16 activations, float32 arithmetic, output in the activation dtype.
 *
 * A decode step is bound by reading the weights, so each weight byte is read once per call:
 * a group of 32 int4 weights (or VEC_WIDTH int8 ones) is widened to float32 in registers once
 * and meets every row of the step there. With one to three rows that leaves too few
 * independent sums to hide the FMA latency, so such calls work on two or four outputs at a
 * time; an output's arithmetic is the same whatever the tile and the row count.
 *
 * Each (row, output) sum runs in one fixed order: per group (int4) or per VEC_WIDTH inputs
 * (int8), lane by lane into one vector accumulator, then vf_sum. A row's result depends on its
 * own inputs only, never on the other rows of the call nor on the thread count.
 *
 * int4 layout (firsttoken/ops/linear.py pack_int4): levels uint8 [out, in / 2], byte j of each
 * group of 32 holds level j (low nibble) and level j + 16 (high nibble); bf16 scales_zeros
 * [out, 2 * groups], a row's group scales then its zeros; w = (level - 8) * scale + zero,
 * computed as level * scale + (zero - 8 * scale).
 */
/* The build allows reassociation for the other kernels; here it could regroup a sum
 * differently in the code for each row count, and a row's bits would follow the batch. Set
 * before any function, with isa.h's FMA contraction: GCC inlines a function only into one
 * built with the same options, and every call here must inline. */
#pragma GCC optimize("no-associative-math", "fp-contract=fast")
#include "common.h"
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

/* One group's 32 weights as float32, in input order: vectors [0, GROUP_VECTORS / 2) from the
 * low nibbles (levels 0-15), the rest from the high ones (levels 16-31). */
static inline void dequantize_group(const uint8_t *packed, float scale, float offset, vfloat *weights) {
    for (int c = 0; c < GROUP_VECTORS / 2; c++) {
        vint levels = vi_load_u8(packed + c * VEC_WIDTH);
        weights[c] = __builtin_convertvector(levels & 15, vfloat) * scale + offset;
        weights[c + GROUP_VECTORS / 2] = __builtin_convertvector(levels >> 4, vfloat) * scale + offset;
    }
}

/* Outputs [o, o + tile) for every row; `rows` and `tile` are compile-time constants at each
 * call site. */
static inline __attribute__((always_inline)) void int4_tile(const Int4Weight *w, const float *x, const int64_t rows,
                                                             const int64_t tile, int64_t o, int dtype, void *out) {
    int64_t in_features = w->in_features, groups = in_features / INT4_GROUP_SIZE;
    vfloat totals[DECODE_MAX_ROWS * MAX_TILE];
    for (int64_t i = 0; i < rows * tile; i++) {
        totals[i] = vf_splat(0.0f);
    }
    for (int64_t g = 0; g < groups; g++) {
        for (int64_t t = 0; t < tile; t++) {
            const uint16_t *scales_zeros = w->scales_zeros + (o + t) * 2 * groups;
            float scale = bf16_to_float(scales_zeros[g]);
            float offset = bf16_to_float(scales_zeros[groups + g]) - 8.0f * scale;
            vfloat weights[GROUP_VECTORS];
            dequantize_group(w->levels + (o + t) * (in_features / 2) + g * (INT4_GROUP_SIZE / 2), scale, offset, weights);
            for (int64_t r = 0; r < rows; r++) {
                const float *inputs = x + r * in_features + g * INT4_GROUP_SIZE;
                for (int c = 0; c < GROUP_VECTORS; c++) {
                    totals[r * tile + t] += weights[c] * vf_load(inputs + c * VEC_WIDTH);
                }
            }
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t t = 0; t < tile; t++) {
            store_output(vf_sum(totals[r * tile + t]), w->bias, o + t, dtype, out, r * w->out_features + o + t);
        }
    }
}

/* Outputs [begin, end): whole tiles, then one output at a time. */
static inline __attribute__((always_inline)) void int4_outputs(const Int4Weight *w, const float *x, const int64_t rows,
                                                                const int64_t tile, int64_t begin, int64_t end,
                                                                int dtype, void *out) {
    int64_t o = begin;
    for (; o + tile <= end; o += tile) {
        int4_tile(w, x, rows, tile, o, dtype, out);
    }
    for (; o < end; o++) {
        int4_tile(w, x, rows, 1, o, dtype, out);
    }
}

/* out [rows, out_features] = x [rows, in_features] . W^T (+ bias) for 1 <= rows <=
 * DECODE_MAX_ROWS, in_features a multiple of 32; x, bias and out contiguous in `dtype`
 * (DTYPE_FLOAT32 or DTYPE_BFLOAT16). Returns FT_OUT_OF_MEMORY when out of memory. */
FtStatus ft_portable_int4_matmul(const uint8_t *levels, const uint16_t *scales_zeros, const void *bias,
                                 int64_t out_features, int64_t in_features, const void *x, int64_t rows, void *out,
                                 int dtype, int num_threads) {
    Int4Weight weight = {levels, scales_zeros, bias, out_features, in_features};
    float *scratch = NULL;
    if (dtype == DTYPE_BFLOAT16 && (scratch = malloc((size_t)(rows * in_features) * sizeof(float))) == NULL) {
        return FT_OUT_OF_MEMORY;
    }
    const float *inputs = float_inputs(x, rows * in_features, dtype, scratch);
#pragma omp parallel num_threads(num_threads) if (out_features * in_features >= 4 * PARALLEL_MIN_ELEMENTS)
    {
        int64_t begin, end;
        thread_rows(out_features, &begin, &end);
#define INT4_BLOCK(n, tile) int4_outputs(&weight, inputs, n, tile, begin, end, dtype, out)
        DISPATCH_QUANTIZED_ROWS(rows, INT4_BLOCK)
#undef INT4_BLOCK
    }
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
