/* Fused row kernels for steps of few rows (decode, short prefill chunks): RMSNorm (after a
 * residual add or not), SiLU-and-mul, rotary, the paged KV write and greedy sampling's argmax;
 * and the build's ISA name.
 *
 * At one to a few hundred rows the plain torch ops cost more in dispatch than in
 * arithmetic (RMSNorm alone is eight ops, rotary seven); each function here is one call,
 * one pass over memory. Every kernel computes in float32 and rounds to the tensor's dtype
 * exactly where the plain torch reference rounds, so bf16 results agree with it up to
 * float32 summation order. dtype: DTYPE_FLOAT32 or DTYPE_BFLOAT16 (raw uint16 bits).
 *
 * Built at run time by firsttoken/ops/native_build.py with the machine's C compiler.
 */
#include "common.h"
#include "isa.h"

static int scratch_rows(int64_t count, int64_t rows, float **scratch) {
    *scratch = malloc((size_t)(count * rows) * sizeof(float));
    return *scratch != NULL;
}

/* rsqrt(mean(x^2) + eps) of a float32 row: the squares summed lane by lane, then across the
 * lanes in vf_sum's fixed order. */
FT_INTERNAL float row_inverse_rms(const float *x, int64_t cols, float eps) {
    vfloat lane_sums = vf_splat(0.0f);
    int64_t c = 0;
    for (; c + VEC_WIDTH <= cols; c += VEC_WIDTH) {
        vfloat value = vf_load(x + c);
        lane_sums = lane_sums + value * value;
    }
    float sum_of_squares = vf_sum(lane_sums);
    for (int64_t tail = c; tail < cols; tail++) {
        sum_of_squares += x[tail] * x[tail];
    }
    return 1.0f / sqrtf(sum_of_squares / (float)cols + eps);
}

/* weight * to_dtype(x * rsqrt(mean(x^2) + eps)), x already in float32 (and in the dtype's values). */
FT_INTERNAL void normalize_row(const float *x, const float *weight, int64_t cols, float eps, int dtype, float *out) {
    float inverse_rms = row_inverse_rms(x, cols, eps);
    int64_t c = 0;
    if (dtype == DTYPE_BFLOAT16) {
        for (; c + VEC_WIDTH <= cols; c += VEC_WIDTH) {
            vf_store(out + c, vf_load(weight + c) * round_lanes_bf16(vf_load(x + c) * inverse_rms));
        }
    } else {
        for (; c + VEC_WIDTH <= cols; c += VEC_WIDTH) {
            vf_store(out + c, vf_load(weight + c) * (vf_load(x + c) * inverse_rms));
        }
    }
    for (; c < cols; c++) {
        out[c] = weight[c] * round_to(x[c] * inverse_rms, dtype);
    }
}

FT_INTERNAL int rms_norm_rows(const void *x, const void *weight, void *out, int64_t begin, int64_t end, int64_t cols,
                         float eps, int dtype) {
    float *scratch;
    if (!scratch_rows(cols, 3, &scratch)) {
        return 0;
    }
    float *weight_f = scratch, *row = scratch + cols, *normed = scratch + 2 * cols;
    load_row(weight, 0, cols, dtype, weight_f);
    for (int64_t r = begin; r < end; r++) {
        load_row(x, r * cols, cols, dtype, row);
        normalize_row(row, weight_f, cols, eps, dtype, normed);
        store_row(normed, cols, dtype, out, r * cols);
    }
    free(scratch);
    return 1;
}

/* out = rms_norm(x) for contiguous x, out [rows, cols]. Returns FT_OUT_OF_MEMORY when out of memory. */
FtStatus ft_rms_norm(const void *x, const void *weight, void *out, int64_t rows, int64_t cols, float eps, int dtype,
                     int num_threads) {
    int succeeded = 1;
#pragma omp parallel num_threads(num_threads) if (rows * cols >= PARALLEL_MIN_ELEMENTS) reduction(&& : succeeded)
    {
        int64_t begin, end;
        thread_rows(rows, &begin, &end);
        succeeded = rms_norm_rows(x, weight, out, begin, end, cols, eps, dtype);
    }
    return succeeded ? FT_OK : FT_OUT_OF_MEMORY;
}

/* row = x[r] + residual[r], rounded to `dtype` and stored to summed[r] as add_rms_norm returns
 * it (residual_row: cols floats of scratch). */
FT_INTERNAL void add_residual_row(const void *x, const void *residual, int64_t r, int64_t cols, int dtype, float *row,
                                  float *residual_row, void *summed) {
#if VECTOR_BF16
    if (dtype == DTYPE_BFLOAT16) { /* one pass for the loads, the add, the rounding and both stores */
        const uint16_t *x_row = (const uint16_t *)x + r * cols, *residual_bits = (const uint16_t *)residual + r * cols;
        uint16_t *summed_row = (uint16_t *)summed + r * cols;
        for (int64_t c = 0; c < cols; c += 16) {
            __mmask16 lanes = tail_mask(cols - c);
            __m512 sum = _mm512_add_ps(load16_bf16(x_row + c, lanes), load16_bf16(residual_bits + c, lanes));
            __m256i rounded = round16_bf16(sum);
            _mm256_mask_storeu_epi16(summed_row + c, lanes, rounded);
            __m512i widened = _mm512_slli_epi32(_mm512_cvtepu16_epi32(rounded), 16);
            _mm512_mask_storeu_ps(row + c, lanes, _mm512_castsi512_ps(widened));
        }
        return;
    }
#endif
    load_row(x, r * cols, cols, dtype, row);
    load_row(residual, r * cols, cols, dtype, residual_row);
    for (int64_t c = 0; c < cols; c++) {
        row[c] += residual_row[c];
    }
    round_row(row, cols, dtype);
    store_row(row, cols, dtype, summed, r * cols);
}

FT_INTERNAL int add_rms_norm_rows(const void *x, const void *residual, const void *weight, void *out, void *summed,
                             int64_t begin, int64_t end, int64_t cols, float eps, int dtype) {
    float *scratch;
    if (!scratch_rows(cols, 4, &scratch)) {
        return 0;
    }
    float *weight_f = scratch, *row = scratch + cols, *residual_row = scratch + 2 * cols;
    float *normed = scratch + 3 * cols;
    load_row(weight, 0, cols, dtype, weight_f);
    for (int64_t r = begin; r < end; r++) {
        add_residual_row(x, residual, r, cols, dtype, row, residual_row, summed);
        normalize_row(row, weight_f, cols, eps, dtype, normed);
        store_row(normed, cols, dtype, out, r * cols);
    }
    free(scratch);
    return 1;
}

/* summed = x + residual; out = rms_norm(summed); all contiguous [rows, cols]. */
FtStatus ft_add_rms_norm(const void *x, const void *residual, const void *weight, void *out, void *summed,
                         int64_t rows, int64_t cols, float eps, int dtype, int num_threads) {
    int succeeded = 1;
#pragma omp parallel num_threads(num_threads) if (rows * cols >= PARALLEL_MIN_ELEMENTS) reduction(&& : succeeded)
    {
        int64_t begin, end;
        thread_rows(rows, &begin, &end);
        succeeded = add_rms_norm_rows(x, residual, weight, out, summed, begin, end, cols, eps, dtype);
    }
    return succeeded ? FT_OK : FT_OUT_OF_MEMORY;
}

/* x / (1 + e^-x) lane by lane; 0 where e^-x overflows (x below -88.7: x / inf). */
static inline vfloat vf_silu(vfloat x) {
#if defined(__AVX512F__)
    return (vfloat)silu16((__m512)x);
#else
    /* isa.h's e^x stops at e^88: below -88 (where the exact values are under 1e-36) take 0. */
    return vf_select(x < -88.0f, vf_splat(0.0f), x / (vf_splat(1.0f) + vf_exp(-x)));
#endif
}

/* Columns [c, c + VEC_WIDTH) of one row: gates and ups multiplied and rounded as the torch
 * reference's three ops round them. */
static inline void silu_and_mul_vector(const void *gate_up, int64_t gate, int64_t up, int64_t c, int dtype,
                                       float *product) {
    if (dtype == DTYPE_BFLOAT16) {
        const uint16_t *bits = gate_up;
        vfloat silu = round_lanes_bf16(vf_silu(vf_load_bf16(bits + gate + c)));
        vf_store(product + c, round_lanes_bf16(silu * vf_load_bf16(bits + up + c)));
    } else {
        const float *values = gate_up;
        vf_store(product + c, vf_silu(vf_load(values + gate + c)) * vf_load(values + up + c));
    }
}

/* One pass, in registers. The columns past the last whole vector go through a zero-padded
 * vector: every column takes the same arithmetic (the W8A8 matmul's SwiGLU epilogue gives
 * these bits whatever the width). */
FT_INTERNAL void silu_and_mul_row(const void *gate_up, int64_t r, int64_t half, int dtype, float *product) {
    int64_t gate = r * 2 * half, up = gate + half, c = 0;
    for (; c + VEC_WIDTH <= half; c += VEC_WIDTH) {
        silu_and_mul_vector(gate_up, gate, up, c, dtype, product);
    }
    int64_t tail = half - c;
    if (tail > 0) {
        size_t element = dtype == DTYPE_BFLOAT16 ? sizeof(uint16_t) : sizeof(float);
        float padded[2 * VEC_WIDTH] = {0}, padded_product[VEC_WIDTH];
        memcpy(padded, (const char *)gate_up + (size_t)(gate + c) * element, (size_t)tail * element);
        memcpy((char *)padded + VEC_WIDTH * element, (const char *)gate_up + (size_t)(up + c) * element,
               (size_t)tail * element);
        silu_and_mul_vector(padded, 0, VEC_WIDTH, 0, dtype, padded_product);
        memcpy(product + c, padded_product, (size_t)tail * sizeof(float));
    }
}

FT_INTERNAL int silu_and_mul_rows(const void *gate_up, void *out, int64_t begin, int64_t end, int64_t half, int dtype) {
    float *scratch;
    if (!scratch_rows(half, 1, &scratch)) {
        return 0;
    }
    for (int64_t r = begin; r < end; r++) {
        silu_and_mul_row(gate_up, r, half, dtype, scratch);
        store_row(scratch, half, dtype, out, r * half);
    }
    free(scratch);
    return 1;
}

/* out [rows, half] = to_dtype(silu(gate)) * up, gate_up contiguous [rows, 2 * half]. */
FtStatus ft_silu_and_mul(const void *gate_up, void *out, int64_t rows, int64_t half, int dtype, int num_threads) {
    int succeeded = 1;
#pragma omp parallel num_threads(num_threads) if (rows * half >= PARALLEL_MIN_ELEMENTS) reduction(&& : succeeded)
    {
        int64_t begin, end;
        thread_rows(rows, &begin, &end);
        succeeded = silu_and_mul_rows(gate_up, out, begin, end, half, dtype);
    }
    return succeeded ? FT_OK : FT_OUT_OF_MEMORY;
}

/* VEC_WIDTH values of x in `dtype` at `index`, as floats; and stored back, rounded to the dtype
 * as store_row rounds (with AVX512-BF16, by its one conversion instruction). */
static inline vfloat load_lanes(const void *x, int64_t index, int dtype) {
    return vf_load_as(x, index, dtype == DTYPE_BFLOAT16);
}

static inline void store_lanes(void *x, int64_t index, vfloat v, int dtype) {
    if (dtype == DTYPE_BFLOAT16) {
#if VECTOR_BF16
        _mm256_storeu_si256((__m256i *)((uint16_t *)x + index), round16_bf16((__m512)v));
#else
        vf_store_bf16((uint16_t *)x + index, v);
#endif
    } else {
        vf_store((float *)x + index, v);
    }
}

/* One head at x[offset] rotated in place in registers, where each half holds whole vectors:
 * x * cos + rotate_half(x) * sin, each product rounded to the dtype as torch rounds it (the
 * scratch path's bits). */
static inline void rotate_head_in_place(void *x, int64_t offset, const float *cos_f, const float *sin_f,
                                        int64_t half, int dtype) {
    for (int64_t d = 0; d < half; d += VEC_WIDTH) {
        vfloat first = load_lanes(x, offset + d, dtype), second = load_lanes(x, offset + half + d, dtype);
        vfloat first_cos = first * vf_load(cos_f + d), second_sin = -second * vf_load(sin_f + d);
        vfloat second_cos = second * vf_load(cos_f + half + d), first_sin = first * vf_load(sin_f + half + d);
        if (dtype == DTYPE_BFLOAT16) {
            first_cos = round_lanes_bf16(first_cos);
            second_sin = round_lanes_bf16(second_sin);
            second_cos = round_lanes_bf16(second_cos);
            first_sin = round_lanes_bf16(first_sin);
        }
        store_lanes(x, offset + d, first_cos + second_sin, dtype);
        store_lanes(x, offset + half + d, second_cos + first_sin, dtype);
    }
}

FT_INTERNAL int rotary_rows(void *x, int64_t row_stride, int64_t begin, int64_t end, int64_t heads, int64_t head_dim,
                       const void *cos, const void *sin, int dtype) {
    float *scratch;
    if (!scratch_rows(head_dim, 4, &scratch)) {
        return 0;
    }
    float *cos_f = scratch, *sin_f = scratch + head_dim, *head = scratch + 2 * head_dim;
    float *rotated = scratch + 3 * head_dim;
    int64_t half = head_dim / 2;
    for (int64_t r = begin; r < end; r++) {
        load_row(cos, r * head_dim, head_dim, dtype, cos_f);
        load_row(sin, r * head_dim, head_dim, dtype, sin_f);
        for (int64_t h = 0; h < heads; h++) {
            int64_t offset = r * row_stride + h * head_dim;
            if (half % VEC_WIDTH == 0) {
                rotate_head_in_place(x, offset, cos_f, sin_f, half, dtype);
                continue;
            }
            load_row(x, offset, head_dim, dtype, head);
            for (int64_t d = 0; d < half; d++) {
                rotated[d] = -head[d + half];
                rotated[d + half] = head[d];
            }
            for (int64_t d = 0; d < head_dim; d++) {
                rotated[d] = round_to(head[d] * cos_f[d], dtype) + round_to(rotated[d] * sin_f[d], dtype);
            }
            store_row(rotated, head_dim, dtype, x, offset);
        }
    }
    free(scratch);
    return 1;
}

/* Rotate-half rotary embedding, in place: x [rows, heads, head_dim] with rows `row_stride`
 * elements apart and heads contiguous; cos, sin contiguous [rows, head_dim] in x's dtype.
 * x * cos + rotate_half(x) * sin, each product rounded to the dtype as torch rounds it. */
FtStatus ft_rotary(void *x, int64_t row_stride, int64_t rows, int64_t heads, int64_t head_dim, const void *cos,
                   const void *sin, int dtype, int num_threads) {
    int succeeded = 1;
#pragma omp parallel num_threads(num_threads) if (rows * heads * head_dim >= PARALLEL_MIN_ELEMENTS) \
    reduction(&& : succeeded)
    {
        int64_t begin, end;
        thread_rows(rows, &begin, &end);
        succeeded = rotary_rows(x, row_stride, begin, end, heads, head_dim, cos, sin, dtype);
    }
    return succeeded ? FT_OK : FT_OUT_OF_MEMORY;
}

/* Copies each row's K and V (row_elems contiguous elements, rows `key_row_stride` and
 * `value_row_stride` apart) to its slot of the paged cache: keys at cache[slot], values at
 * cache[values_offset / row_elems + slot]; a prefill's rows split over the threads (a new
 * cache's pages fault on their first write, in parallel too).
 * Returns FT_OUT_OF_BOUNDS, copying nothing, when a slot lies outside [0, num_slots). */
FtStatus ft_write_kv(void *cache, int64_t values_offset, int64_t num_slots, const void *key, int64_t key_row_stride,
                     const void *value, int64_t value_row_stride, const int64_t *slots, int64_t rows, int64_t row_elems,
                     int dtype, int num_threads) {
    for (int64_t r = 0; r < rows; r++) {
        if (slots[r] < 0 || slots[r] >= num_slots) {
            return FT_OUT_OF_BOUNDS;
        }
    }
    size_t element_size = dtype == DTYPE_BFLOAT16 ? 2 : 4;
    size_t row_bytes = (size_t)row_elems * element_size;
    char *keys = cache, *values = keys + (size_t)values_offset * element_size;
#pragma omp parallel num_threads(num_threads) if (rows * row_elems >= PARALLEL_MIN_ELEMENTS)
    {
        int64_t begin, end;
        thread_rows(rows, &begin, &end);
        for (int64_t r = begin; r < end; r++) {
            size_t destination = (size_t)slots[r] * row_bytes;
            memcpy(keys + destination, (const char *)key + (size_t)(r * key_row_stride) * element_size, row_bytes);
            memcpy(values + destination, (const char *)value + (size_t)(r * value_row_stride) * element_size,
                   row_bytes);
        }
    }
    return FT_OK;
}

/* Vectors of one row an argmax pass compares at a time: independent chains, so a comparison
 * never waits on the one before it. */
#define ARGMAX_CHAINS 4

/* The index of the row's first NaN, or -1. */
static int64_t first_nan(const float *row, int64_t cols) {
    for (int64_t c = 0; c < cols; c++) {
        if (row[c] != row[c]) {
            return c;
        }
    }
    return -1;
}

/* The index torch.argmax gives: the first NaN where the row holds one (NaN counts as the
 * largest), else the first of the largest values. Each chain of lanes keeps the first
 * index of its largest value (a strict comparison); across them the smallest index among the
 * equal largest values wins, which is the row's first. */
static int64_t argmax_row(const float *row, int64_t cols) {
    const int64_t stride = ARGMAX_CHAINS * VEC_WIDTH;
    vfloat best[ARGMAX_CHAINS];
    vint best_at[ARGMAX_CHAINS], at[ARGMAX_CHAINS];
    vint unordered = {0};
    int64_t c = 0;
    if (cols >= stride) {
        for (int chain = 0; chain < ARGMAX_CHAINS; chain++) {
            best[chain] = vf_load(row + chain * VEC_WIDTH);
            at[chain] = best_at[chain] = vi_lane_indices() + chain * VEC_WIDTH;
            unordered |= best[chain] != best[chain];
        }
        for (c = stride; c + stride <= cols; c += stride) {
            for (int chain = 0; chain < ARGMAX_CHAINS; chain++) {
                vfloat value = vf_load(row + c + chain * VEC_WIDTH);
                at[chain] += (int32_t)stride;
                vint greater = value > best[chain];
                best[chain] = vf_select(greater, value, best[chain]);
                best_at[chain] = (greater & at[chain]) | (~greater & best_at[chain]);
                unordered |= value != value;
            }
        }
    }
    for (int lane = 0; lane < VEC_WIDTH; lane++) {
        if (unordered[lane]) {
            return first_nan(row, cols);
        }
    }
    float best_value = row[0];
    int64_t best_index = 0;
    if (c > 0) {
        for (int chain = 0; chain < ARGMAX_CHAINS; chain++) {
            for (int lane = 0; lane < VEC_WIDTH; lane++) {
                float value = best[chain][lane];
                int64_t index = best_at[chain][lane];
                if (value > best_value || (value == best_value && index < best_index)) {
                    best_value = value;
                    best_index = index;
                }
            }
        }
    }
    for (; c < cols; c++) {
        if (row[c] != row[c]) {
            return c;
        }
        if (row[c] > best_value) {
            best_value = row[c];
            best_index = c;
        }
    }
    return best_index;
}

/* token_ids [rows] (int64) = argmax_row of each row of logits float32 [rows, cols] (contiguous). */
FtStatus ft_argmax_rows(const float *logits, int64_t *token_ids, int64_t rows, int64_t cols, int num_threads) {
#pragma omp parallel num_threads(num_threads) if (rows * cols >= PARALLEL_MIN_ELEMENTS)
    {
        int64_t begin, end;
        thread_rows(rows, &begin, &end);
        for (int64_t r = begin; r < end; r++) {
            token_ids[r] = argmax_row(logits + r * cols, cols);
        }
    }
    return FT_OK;
}

/* The instruction set this build targets, as the compiler saw it. */
const char *ft_isa_name(void) {
#if defined(__AMX_BF16__) && VECTOR_BF16
    return "avx512_bf16+amx";
#elif VECTOR_BF16
    return "avx512_bf16";
#elif defined(__AVX512F__)
    return "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
    return "avx2";
#elif defined(__ARM_NEON)
    return "neon";
#else
    return "generic";
#endif
}
