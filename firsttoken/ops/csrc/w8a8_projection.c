/* A W8A8 projection in one call: its inputs quantized (ft_quantize_rows_int8, or straight from
 * their RMSNorm: ft_rms_norm_quantize_int8) and multiplied (ft_w8a8_matmul) back to back, the
 * levels in a buffer of this call's own.
 *
 * Between two calls from Python a step pays for the interpreter's work (the wrappers, the levels'
 * and scales' tensors), and that work runs slow after a kernel has filled the caches with the
 * step's rows: one call per projection where there were two. The passes are the same functions,
 * so the bits are theirs.
 */
#include "common.h"

#if defined(__AVX2__)
/* uint8 levels [rows, cols] and float32 scales [rows] in one allocation, 64-byte aligned like
 * torch's tensors (at least 64 bytes: no rows is no failure); NULL when out of memory. Free with
 * free(levels). */
static uint8_t *quantized_rows(int64_t rows, int64_t cols, float **scales) {
    size_t level_bytes = ((size_t)(rows * cols) + 63) / 64 * 64;
    size_t total = (level_bytes + (size_t)rows * sizeof(float) + 63) / 64 * 64;
    total = total > 0 ? total : 64;
    uint8_t *levels = aligned_alloc(64, total);
    *scales = levels != NULL ? (float *)(levels + level_bytes) : NULL;
    return levels;
}

/* out = the W8A8 projection of x [rows, in_features] (where silu_gated_inputs, SwiGLU's product
 * of x [rows, 2 * in_features], gate | up): x quantized as ft_quantize_rows_int8 quantizes it
 * (column_scales, hadamard_block as there), then multiplied as ft_w8a8_matmul multiplies the
 * levels (weight to silu_gated as there). */
FtStatus ft_w8a8_quantize_matmul(const void *x, int silu_gated_inputs, const float *column_scales,
                                 int64_t hadamard_block, float hadamard_norm, const void *weight,
                                 const float *weight_scales, const float *bias, void *out, int64_t rows,
                                 int64_t out_features, int64_t in_features, int dtype, int num_threads, int use_amx,
                                 int silu_gated) {
    float *scales;
    uint8_t *levels = quantized_rows(rows, in_features, &scales);
    if (levels == NULL) {
        return FT_OUT_OF_MEMORY;
    }
    FtStatus status = ft_quantize_rows_int8(x, silu_gated_inputs, column_scales, hadamard_block, hadamard_norm, levels,
                                            scales, rows, in_features, dtype, num_threads);
    if (status == FT_OK) {
        status = ft_w8a8_matmul(levels, scales, weight, weight_scales, bias, out, rows, out_features, in_features,
                                dtype, num_threads, use_amx, silu_gated);
    }
    free(levels);
    return status;
}

/* out = the W8A8 projection of rms_norm(x + residual) (residual NULL: of rms_norm(x)), x and
 * residual [rows, in_features]: quantized in the norm's pass as ft_rms_norm_quantize_int8 does it
 * (summed = x + residual as there), then multiplied as ft_w8a8_matmul multiplies the levels. */
FtStatus ft_w8a8_norm_matmul(const void *x, const void *residual, const void *norm_weight, void *summed, float eps,
                             const float *column_scales, int64_t hadamard_block, float hadamard_norm,
                             const void *weight, const float *weight_scales, const float *bias, void *out,
                             int64_t rows, int64_t out_features, int64_t in_features, int dtype, int num_threads,
                             int use_amx, int silu_gated) {
    float *scales;
    uint8_t *levels = quantized_rows(rows, in_features, &scales);
    if (levels == NULL) {
        return FT_OUT_OF_MEMORY;
    }
    FtStatus status = ft_rms_norm_quantize_int8(x, residual, norm_weight, summed, eps, column_scales, hadamard_block,
                                                hadamard_norm, levels, scales, rows, in_features, dtype, num_threads);
    if (status == FT_OK) {
        status = ft_w8a8_matmul(levels, scales, weight, weight_scales, bias, out, rows, out_features, in_features,
                                dtype, num_threads, use_amx, silu_gated);
    }
    free(levels);
    return status;
}
#endif
