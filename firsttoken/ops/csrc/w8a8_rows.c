/* The row passes around a W8A8 projection's int8 matmul (firsttoken/ops/w8a8_linear.py): each row
 * of activations quantized to int8 with its own scale on the way in, each row of products
 * scaled back on the way out. In torch ops they are eight passes over the step, which cost
 * more than the matmul; here one each, vectorized over isa.h.
 *
 * Both do the float32 operations of the torch path in its order (no fused multiply-add: this
 * file keeps ISO C's contraction rules), so they give its bits.
 */
#include "common.h"
#include "isa.h"

static float row_abs_max(const float *row, int64_t cols) {
    vfloat largest = vf_splat(0.0f);
    int64_t c = 0;
    for (; c + VEC_WIDTH <= cols; c += VEC_WIDTH) {
        vfloat v = vf_load(row + c);
        largest = vf_max(largest, vf_max(v, -v));
    }
    float result = vf_max_lane(largest);
    for (; c < cols; c++) {
        result = fmaxf(result, fabsf(row[c]));
    }
    return result;
}

/* round-half-even(x * inverse_scale) clamped to +-127, + 128, as bytes. Clamping before
 * rounding gives the same levels as after: the bounds are whole numbers. */
static void quantize_row(const float *row, float inverse_scale, int64_t cols, uint8_t *levels) {
    int64_t c = 0;
    for (; c + VEC_WIDTH <= cols; c += VEC_WIDTH) {
        vfloat level = vf_min(vf_max(vf_load(row + c) * inverse_scale, vf_splat(-127.0f)), vf_splat(127.0f));
        vbyte bytes = __builtin_convertvector(vi_round_even(level) + 128, vbyte);
        memcpy(levels + c, &bytes, sizeof bytes);
    }
    for (; c < cols; c++) {
        float level = fminf(fmaxf(nearbyintf(row[c] * inverse_scale), -127.0f), 127.0f);
        levels[c] = (uint8_t)(int32_t)(level + 128.0f);
    }
}

/* Vectors whose butterflies run in registers, loaded once: every stage whose pairs lie within
 * HADAMARD_GROUP vectors of each other, before the farther stages go over memory. */
#define HADAMARD_GROUP 8

/* Holds a stage's result as computed: the build's -fassociative-math would otherwise regroup
 * the sums of consecutive stages while they stay in registers, and the bits would differ from
 * the butterflies' (and the torch reference's). */
static inline void pin_vector(vfloat *v) {
    __asm__("" : "+v"(*v));
}

/* Each lane's butterfly with its partner `half` lanes away (half < VEC_WIDTH): a pair's first
 * lane takes v + partner, its second partner + (-v) = partner - v, each one addition (the sign
 * flip is exact). */
static inline vfloat butterflies_within(vfloat v, int32_t half) {
    vint lanes = vi_lane_indices();
    vint partners = lanes ^ half, second_signs = (vint)(((lanes & half) != 0) & (int32_t)0x80000000);
    return __builtin_shuffle(v, partners) + (vfloat)((vint)v ^ second_signs);
}

/* The butterflies of pairs 1, 2, 4, ..., HADAMARD_GROUP * VEC_WIDTH / 2 apart over the
 * HADAMARD_GROUP vectors of `group`, in registers: within each vector, then between vectors, the
 * same additions as walsh_hadamard_block's. */
static inline __attribute__((always_inline)) void hadamard_group_in_registers(vfloat group[HADAMARD_GROUP]) {
    for (int32_t half = 1; half < VEC_WIDTH; half *= 2) {
#pragma GCC unroll 8
        for (int g = 0; g < HADAMARD_GROUP; g++) {
            group[g] = butterflies_within(group[g], half);
            pin_vector(&group[g]);
        }
    }
    /* Unrolled whole, so the group stays in registers (GCC leaves these loops rolled, the
     * group on the stack). */
#pragma GCC unroll 8
    for (int distance = 1; distance < HADAMARD_GROUP; distance *= 2) {
#pragma GCC unroll 8
        for (int g = 0; g < HADAMARD_GROUP; g++) {
            if ((g & distance) == 0) {
                vfloat first = group[g], second = group[g + distance];
                group[g] = first + second;
                group[g + distance] = first - second;
                pin_vector(&group[g]);
                pin_vector(&group[g + distance]);
            }
        }
    }
}

/* `count` vectors times `norm` (the transform's last step) stored to `values`; returns the largest
 * magnitude so far (`largest`) and theirs, lane by lane. */
static inline __attribute__((always_inline)) vfloat store_scaled_tracking_max(float *const values[], vfloat *vectors,
                                                                               int count, float norm, vfloat largest) {
    for (int i = 0; i < count; i++) {
        vfloat value = vectors[i] * norm;
        vf_store(values[i], value);
        largest = vf_max(largest, vf_max(value, -value));
    }
    return largest;
}

/* The stages of pairs `far_half` apart and farther of a block whose nearer stages are done:
 * each stage but the last two one pass over memory; the last two together, four vectors at a
 * time in registers (each element the same two additions, in the same order), the last times
 * `norm` as it stores. Returns the largest magnitude of the block's outputs, lane by lane. */
static vfloat far_hadamard_stages(float *values, int64_t block, int64_t far_half, float norm) {
    vfloat largest = vf_splat(0.0f);
    int64_t last_half = block / 2;
    if (far_half > last_half) { /* no stage left over memory */
        for (int64_t i = 0; i < block; i += VEC_WIDTH) {
            vfloat value = vf_load(values + i);
            largest = store_scaled_tracking_max((float *const[]){values + i}, &value, 1, norm, largest);
        }
        return largest;
    }
    if (far_half == last_half) {
        for (int64_t i = 0; i < last_half; i += VEC_WIDTH) {
            vfloat first = vf_load(values + i), second = vf_load(values + i + last_half);
            vfloat outputs[2] = {first + second, first - second};
            largest = store_scaled_tracking_max((float *const[]){values + i, values + i + last_half}, outputs, 2, norm,
                                                largest);
        }
        return largest;
    }
    int64_t quarter = block / 4;
    for (int64_t half = far_half; half < quarter; half *= 2) {
        for (int64_t start = 0; start < block; start += 2 * half) {
            for (int64_t i = start; i < start + half; i += VEC_WIDTH) {
                vfloat first = vf_load(values + i), second = vf_load(values + i + half);
                vf_store(values + i, first + second);
                vf_store(values + i + half, first - second);
            }
        }
    }
    for (int64_t i = 0; i < quarter; i += VEC_WIDTH) {
        float *const places[4] = {values + i, values + i + quarter, values + i + 2 * quarter, values + i + 3 * quarter};
        vfloat a = vf_load(places[0]), b = vf_load(places[1]), c = vf_load(places[2]), d = vf_load(places[3]);
        vfloat nearer[4] = {a + b, a - b, c + d, c - d};
        for (int v = 0; v < 4; v++) {
            pin_vector(&nearer[v]);
        }
        vfloat outputs[4] = {nearer[0] + nearer[2], nearer[1] + nearer[3], nearer[0] - nearer[2],
                             nearer[1] - nearer[3]};
        largest = store_scaled_tracking_max(places, outputs, 4, norm, largest);
    }
    return largest;
}

/* In place: `values` [block] times the orthonormal Hadamard matrix of that order (a power of
 * two), as firsttoken/ops/hadamard.py's `walsh_hadamard_rows` computes it, addition by addition:
 * butterflies a + b, a - b over pairs 1, 2, 4, ... apart, then times `norm` (1 / sqrt(block)).
 * Vectorized where the block holds whole vectors: pairs closer than a vector meet within one,
 * each lane beside its partner's copy (lanes swapped by the pair distance); farther pairs are
 * whole vectors apart. A block of HADAMARD_GROUP vectors or more takes its nearer stages in
 * registers, a group at a time, loaded from `bf16_source` where not NULL (the block's bf16
 * values, widened as they load) and from `values` otherwise. Each element takes the same
 * additions either way. Returns the largest magnitude of the outputs. */
static float walsh_hadamard_block(const uint16_t *bf16_source, float *values, int64_t block, float norm) {
    if (block >= HADAMARD_GROUP * VEC_WIDTH) {
        for (int64_t start = 0; start < block; start += HADAMARD_GROUP * VEC_WIDTH) {
            vfloat group[HADAMARD_GROUP];
            if (bf16_source != NULL) {
#pragma GCC unroll 8
                for (int g = 0; g < HADAMARD_GROUP; g++) {
                    group[g] = vf_load_bf16(bf16_source + start + g * VEC_WIDTH);
                }
            } else {
#pragma GCC unroll 8
                for (int g = 0; g < HADAMARD_GROUP; g++) {
                    group[g] = vf_load(values + start + g * VEC_WIDTH);
                }
            }
            hadamard_group_in_registers(group);
#pragma GCC unroll 8
            for (int g = 0; g < HADAMARD_GROUP; g++) {
                vf_store(values + start + g * VEC_WIDTH, group[g]);
            }
        }
        return vf_max_lane(far_hadamard_stages(values, block, HADAMARD_GROUP * VEC_WIDTH, norm));
    }
    if (bf16_source != NULL) {
        for (int64_t i = 0; i < block; i++) {
            values[i] = bf16_to_float(bf16_source[i]);
        }
    }
    if (block >= VEC_WIDTH) {
        for (int32_t half = 1; half < VEC_WIDTH; half *= 2) {
            for (int64_t i = 0; i < block; i += VEC_WIDTH) {
                vf_store(values + i, butterflies_within(vf_load(values + i), half));
            }
        }
        return vf_max_lane(far_hadamard_stages(values, block, VEC_WIDTH, norm));
    }
    for (int64_t half = 1; half < block; half *= 2) {
        for (int64_t start = 0; start < block; start += 2 * half) {
            for (int64_t i = start; i < start + half; i++) {
                float first = values[i], second = values[i + half];
                values[i] = first + second;
                values[i + half] = first - second;
            }
        }
    }
    float largest = 0.0f;
    for (int64_t i = 0; i < block; i++) {
        values[i] *= norm;
        largest = fmaxf(largest, fabsf(values[i]));
    }
    return largest;
}

/* A row's levels and scale from its absolute maximum (a zero row: scale 1). */
static void quantize_with_max(const float *row, float row_max, int64_t cols, uint8_t *levels, float *scale) {
    quantize_row(row, row_max > 0.0f ? 127.0f / row_max : 1.0f, cols, levels);
    *scale = row_max > 0.0f ? row_max / 127.0f : 1.0f;
}

/* A row turned in blocks of hadamard_block, then its levels and scale: the row's largest
 * magnitude taken as each block's last stage stores. From `bf16_source` (a bf16 row read
 * straight from the activations) where not NULL, else from `row`, the row in float32. */
static void quantize_turned_row(const uint16_t *bf16_source, float *row, int64_t hadamard_block, float hadamard_norm,
                                int64_t cols, uint8_t *levels, float *scale) {
    float row_max = 0.0f;
    for (int64_t start = 0; start < cols; start += hadamard_block) {
        const uint16_t *block_source = bf16_source != NULL ? bf16_source + start : NULL;
        row_max = fmaxf(row_max, walsh_hadamard_block(block_source, row + start, hadamard_block, hadamard_norm));
    }
    quantize_with_max(row, row_max, cols, levels, scale);
}

/* One row in float32 (holding values of the activations' dtype) quantized in place of the
 * pass over stored rows: times column_scales unless NULL, turned in blocks of hadamard_block
 * where above 1, then its levels (row is overwritten) and its scale. */
static void quantize_float_row(float *row, const float *column_scales, int64_t hadamard_block, float hadamard_norm,
                               int64_t cols, uint8_t *levels, float *scale) {
    if (column_scales != NULL) {
        for (int64_t c = 0; c < cols; c++) {
            row[c] *= column_scales[c];
        }
    }
    if (hadamard_block > 1) {
        quantize_turned_row(NULL, row, hadamard_block, hadamard_norm, cols, levels, scale);
        return;
    }
    quantize_with_max(row, row_abs_max(row, cols), cols, levels, scale);
}

/* The levels of a plain bf16 row (no column scales, no turn): its widened values kept in `row`
 * while their absolute maximum is taken, in one pass, then the levels. */
static void quantize_bf16_row(const uint16_t *bits, int64_t cols, float *row, uint8_t *levels, float *scale) {
    vfloat largest = vf_splat(0.0f);
    int64_t c = 0;
    for (; c + VEC_WIDTH <= cols; c += VEC_WIDTH) {
        vfloat v = vf_load_bf16(bits + c);
        vf_store(row + c, v);
        largest = vf_max(largest, vf_max(v, -v));
    }
    float row_max = vf_max_lane(largest);
    for (; c < cols; c++) {
        row[c] = bf16_to_float(bits[c]);
        row_max = fmaxf(row_max, fabsf(row[c]));
    }
    quantize_with_max(row, row_max, cols, levels, scale);
}

static int quantize_rows_range(const void *x, int silu_gated, const float *column_scales, int64_t hadamard_block,
                               float hadamard_norm, uint8_t *levels, float *scales, int64_t begin, int64_t end,
                               int64_t cols, int dtype) {
    float *row = malloc((size_t)cols * sizeof(float));
    if (row == NULL) {
        return 0;
    }
    int plain_bf16 = !silu_gated && column_scales == NULL && dtype == DTYPE_BFLOAT16;
    for (int64_t r = begin; r < end; r++) {
        if (plain_bf16 && hadamard_block > 1) {
            quantize_turned_row((const uint16_t *)x + r * cols, row, hadamard_block, hadamard_norm, cols,
                                levels + r * cols, scales + r);
            continue;
        }
        if (plain_bf16) {
            quantize_bf16_row((const uint16_t *)x + r * cols, cols, row, levels + r * cols, scales + r);
            continue;
        }
        if (silu_gated) {
            /* The values ft_silu_and_mul would store and this pass read back. */
            silu_and_mul_row(x, r, cols, dtype, row);
        } else {
            load_row(x, r * cols, cols, dtype, row);
        }
        quantize_float_row(row, column_scales, hadamard_block, hadamard_norm, cols, levels + r * cols, scales + r);
    }
    free(row);
    return 1;
}

/* Each row of x [rows, cols] (in `dtype`; where silu_gated, SwiGLU's product of x [rows, 2 * cols],
 * gate | up, rounded to `dtype` as ft_silu_and_mul stores it; times column_scales [cols] unless
 * NULL, SmoothQuant's 1 / s; then, where hadamard_block > 1, each block of that many columns
 * turned by the Walsh-Hadamard transform, a rotated model's down_proj inputs) in symmetric int8
 * with its own scale, absmax / 127 (1 for a zero row), the levels x * (127 / absmax) rounded:
 * levels uint8 [rows, cols] (the int8 level + 128), scales float32 [rows]. */
FtStatus ft_quantize_rows_int8(const void *x, int silu_gated, const float *column_scales, int64_t hadamard_block,
                               float hadamard_norm, uint8_t *levels, float *scales, int64_t rows, int64_t cols,
                               int dtype, int num_threads) {
    int succeeded = 1;
#pragma omp parallel num_threads(num_threads) if (rows * cols >= PARALLEL_MIN_ELEMENTS) reduction(&& : succeeded)
    {
        int64_t begin, end;
        thread_rows(rows, &begin, &end);
        succeeded = quantize_rows_range(x, silu_gated, column_scales, hadamard_block, hadamard_norm, levels, scales,
                                        begin, end, cols, dtype);
    }
    return succeeded ? FT_OK : FT_OUT_OF_MEMORY;
}

/* A plain row's norm as ft_add_rms_norm stores it (normalize_row, rounded to the dtype) written
 * to `normed` with its absolute maximum taken in the same pass, then its levels and scale: the
 * separate passes' bits (normalize, round, maximum, levels) in two fewer passes over the row. */
static void normalize_and_quantize(const float *row, const float *weight, int64_t cols, float eps, int dtype,
                                   float *normed, uint8_t *levels, float *scale) {
    float inverse_rms = row_inverse_rms(row, cols, eps);
    vfloat largest = vf_splat(0.0f);
    int64_t c = 0;
    for (; c + VEC_WIDTH <= cols; c += VEC_WIDTH) {
        vfloat value = vf_load(row + c) * inverse_rms;
        if (dtype == DTYPE_BFLOAT16) {
            value = round_lanes_bf16(vf_load(weight + c) * round_lanes_bf16(value));
        } else {
            value = vf_load(weight + c) * value;
        }
        vf_store(normed + c, value);
        largest = vf_max(largest, vf_max(value, -value));
    }
    float row_max = vf_max_lane(largest);
    int64_t tail = c;
    for (; c < cols; c++) {
        normed[c] = weight[c] * round_to(row[c] * inverse_rms, dtype);
    }
    round_row(normed + tail, cols - tail, dtype);
    for (c = tail; c < cols; c++) {
        row_max = fmaxf(row_max, fabsf(normed[c]));
    }
    quantize_with_max(normed, row_max, cols, levels, scale);
}

static int norm_quantize_rows_range(const void *x, const void *residual, const void *weight, void *summed, float eps,
                                    const float *column_scales, int64_t hadamard_block, float hadamard_norm,
                                    uint8_t *levels, float *scales, int64_t begin, int64_t end, int64_t cols,
                                    int dtype) {
    float *scratch = malloc((size_t)(3 * cols) * sizeof(float));
    if (scratch == NULL) {
        return 0;
    }
    float *weight_f = scratch, *row = scratch + cols, *normed = scratch + 2 * cols;
    load_row(weight, 0, cols, dtype, weight_f);
    for (int64_t r = begin; r < end; r++) {
        if (residual != NULL) {
            /* `normed` is free until the norm below: scratch for the residual's row. */
            add_residual_row(x, residual, r, cols, dtype, row, normed, summed);
        } else {
            load_row(x, r * cols, cols, dtype, row);
        }
        if (column_scales == NULL && hadamard_block <= 1) {
            normalize_and_quantize(row, weight_f, cols, eps, dtype, normed, levels + r * cols, scales + r);
            continue;
        }
        normalize_row(row, weight_f, cols, eps, dtype, normed);
        /* The norm's row as stored in `dtype` and read back by the quantization pass. */
        round_row(normed, cols, dtype);
        quantize_float_row(normed, column_scales, hadamard_block, hadamard_norm, cols, levels + r * cols, scales + r);
    }
    free(scratch);
    return 1;
}

/* A W8A8 projection's input straight from its RMSNorm: rms_norm(x + residual) (residual NULL:
 * rms_norm(x)) quantized as ft_quantize_rows_int8 quantizes the norm's stored rows (column_scales,
 * hadamard_block as there), the same levels and scales without the normed rows written and read
 * back; summed = x + residual as ft_add_rms_norm stores it (untouched where residual is NULL). */
FtStatus ft_rms_norm_quantize_int8(const void *x, const void *residual, const void *weight, void *summed, float eps,
                                   const float *column_scales, int64_t hadamard_block, float hadamard_norm,
                                   uint8_t *levels, float *scales, int64_t rows, int64_t cols, int dtype,
                                   int num_threads) {
    int succeeded = 1;
#pragma omp parallel num_threads(num_threads) if (rows * cols >= PARALLEL_MIN_ELEMENTS) reduction(&& : succeeded)
    {
        int64_t begin, end;
        thread_rows(rows, &begin, &end);
        succeeded = norm_quantize_rows_range(x, residual, weight, summed, eps, column_scales, hadamard_block,
                                             hadamard_norm, levels, scales, begin, end, cols, dtype);
    }
    return succeeded ? FT_OK : FT_OUT_OF_MEMORY;
}

static int rescale_rows_range(const float *sums, const float *row_scales, const float *bias, void *out,
                              int64_t begin, int64_t end, int64_t cols, int dtype) {
    float *row = malloc((size_t)cols * sizeof(float));
    if (row == NULL) {
        return 0;
    }
    for (int64_t r = begin; r < end; r++) {
        const float *row_sums = sums + r * cols;
        float scale = row_scales[r];
        for (int64_t c = 0; c < cols; c++) {
            row[c] = row_sums[c] * scale;
        }
        if (bias != NULL) {
            for (int64_t c = 0; c < cols; c++) {
                row[c] += bias[c];
            }
        }
        store_row(row, cols, dtype, out, r * cols);
    }
    free(row);
    return 1;
}

/* out [rows, cols] in `dtype` = sums float32 [rows, cols] * row_scales [rows] (+ float32 bias
 * [cols]): a W8A8 product's rows (already times the weight scales) scaled back by their
 * activations' scales. */
FtStatus ft_rescale_rows(const float *sums, const float *row_scales, const float *bias, void *out, int64_t rows,
                         int64_t cols, int dtype, int num_threads) {
    int succeeded = 1;
#pragma omp parallel num_threads(num_threads) if (rows * cols >= PARALLEL_MIN_ELEMENTS) reduction(&& : succeeded)
    {
        int64_t begin, end;
        thread_rows(rows, &begin, &end);
        succeeded = rescale_rows_range(sums, row_scales, bias, out, begin, end, cols, dtype);
    }
    return succeeded ? FT_OK : FT_OUT_OF_MEMORY;
}
