/* What every kernel source shares: bf16 conversions, row loads and stores in either dtype
 * (DTYPE_FLOAT32 or DTYPE_BFLOAT16, raw uint16 bits), a vector exp and the split of rows over
 * OpenMP threads. */
#ifndef FIRSTTOKEN_COMMON_H
#define FIRSTTOKEN_COMMON_H

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
/* The limits, dtype codes and structs Python shares with these kernels, written by the
 * build from firsttoken/ops/native_abi.py (their one definition). */
#include "native_abi.h"

static inline float bf16_to_float(uint16_t bits) {
    uint32_t widened = (uint32_t)bits << 16;
    float value;
    memcpy(&value, &widened, sizeof value);
    return value;
}

/* Round to nearest even, as torch does; NaN stays a quiet NaN. */
static inline uint16_t float_to_bf16(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) {
        return (uint16_t)((bits >> 16) | 0x40u);
    }
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* The value a float32 result takes once stored in `dtype`, as a float32. */
static inline float round_to(float value, int dtype) {
    return dtype == DTYPE_BFLOAT16 ? bf16_to_float(float_to_bf16(value)) : value;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define VECTOR_BF16 1
/* Lanes [0, count) of 16, for a row's tail. */
static inline __mmask16 tail_mask(int64_t count) {
    return count >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << count) - 1);
}

static inline __m512 load16_bf16(const uint16_t *source, __mmask16 lanes) {
    __m256i bits = _mm256_maskz_loadu_epi16(lanes, source);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

/* Round to nearest even, as torch does (NaN stays NaN; a denormal input flushes to zero). */
static inline __m256i round16_bf16(__m512 value) {
    return (__m256i)_mm512_cvtneps_pbh(value);
}
#endif

static inline void load_row(const void *source, int64_t offset, int64_t count, int dtype, float *destination) {
    if (dtype == DTYPE_BFLOAT16) {
        const uint16_t *bits = (const uint16_t *)source + offset;
        int64_t i = 0;
#if VECTOR_BF16
        for (; i < count; i += 16) {
            __mmask16 lanes = tail_mask(count - i);
            _mm512_mask_storeu_ps(destination + i, lanes, load16_bf16(bits + i, lanes));
        }
#endif
        for (; i < count; i++) {
            destination[i] = bf16_to_float(bits[i]);
        }
    } else {
        memcpy(destination, (const float *)source + offset, (size_t)count * sizeof(float));
    }
}

static inline void store_row(const float *source, int64_t count, int dtype, void *destination, int64_t offset) {
    if (dtype == DTYPE_BFLOAT16) {
        uint16_t *bits = (uint16_t *)destination + offset;
        int64_t i = 0;
#if VECTOR_BF16
        for (; i < count; i += 16) {
            __mmask16 lanes = tail_mask(count - i);
            _mm256_mask_storeu_epi16(bits + i, lanes, round16_bf16(_mm512_maskz_loadu_ps(lanes, source + i)));
        }
#endif
        for (; i < count; i++) {
            bits[i] = float_to_bf16(source[i]);
        }
    } else {
        memcpy((float *)destination + offset, source, (size_t)count * sizeof(float));
    }
}

/* Rounds every element to `dtype` in place (a no-op for float32). */
static inline void round_row(float *row, int64_t count, int dtype) {
    if (dtype != DTYPE_BFLOAT16) {
        return;
    }
    int64_t i = 0;
#if VECTOR_BF16
    for (; i < count; i += 16) {
        __mmask16 lanes = tail_mask(count - i);
        __m256i rounded = round16_bf16(_mm512_maskz_loadu_ps(lanes, row + i));
        _mm512_mask_storeu_ps(row + i, lanes, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(rounded), 16)));
    }
#endif
    for (; i < count; i++) {
        row[i] = bf16_to_float(float_to_bf16(row[i]));
    }
}

/* Every block id a sequence reads lies inside the cache and every length inside its table: 1, else 0. */
static inline int tables_in_bounds(int64_t num_slots, const int64_t *block_table, int64_t max_blocks, int64_t block_size,
                            const int64_t *seq_lens, int64_t num_sequences) {
    int64_t num_blocks = num_slots / block_size;
    for (int64_t s = 0; s < num_sequences; s++) {
        int64_t seq_len = seq_lens[s];
        if (seq_len < 1 || seq_len > max_blocks * block_size) {
            return 0;
        }
        for (int64_t block = 0; block < (seq_len + block_size - 1) / block_size; block++) {
            int64_t id = block_table[s * max_blocks + block];
            if (id < 0 || id >= num_blocks) {
                return 0;
            }
        }
    }
    return 1;
}

static inline int64_t max_i64(int64_t a, int64_t b) {
    return a > b ? a : b;
}

static inline int64_t element_size(int dtype) {
    return dtype == DTYPE_BFLOAT16 ? 2 : 4;
}

/* The cases of a switch over a tile's row count, CASE(count) each (the including file's macro):
 * every count its own unrolled code. */
#define TILE_CASES_1_TO_6(CASE) CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6)
#define TILE_CASES_7_TO_12(CASE) CASE(7) CASE(8) CASE(9) CASE(10) CASE(11) CASE(12)

/* Steps of fewer elements stay on the calling thread: waking the others costs more. */
#define PARALLEL_MIN_ELEMENTS 65536

/* This thread's share [begin, end) of `rows` inside an OpenMP parallel region. */
static inline void thread_rows(int64_t rows, int64_t *begin, int64_t *end) {
    int64_t threads = omp_get_num_threads(), thread = omp_get_thread_num();
    *begin = rows * thread / threads;
    *end = rows * (thread + 1) / threads;
}

/* A thread's share of a product tiled as row tiles by panels of outputs. */
typedef struct {
    int64_t row_begin, row_end, panel_begin, panel_end;
} ProductShare;

/* This thread's share inside an OpenMP parallel region: whole panels (every row) where there are
 * panels enough for every thread or too few rows, else whole tiles of `tile_rows` rows (every
 * panel). Either way each output is one thread's alone. */
static inline ProductShare thread_product_share(int64_t rows, int64_t panels, int64_t tile_rows) {
    int64_t threads = omp_get_num_threads(), thread = omp_get_thread_num();
    ProductShare share = {0, rows, 0, panels};
    if (panels >= 4 * threads || rows < 2 * tile_rows * threads) {
        thread_rows(panels, &share.panel_begin, &share.panel_end);
    } else {
        int64_t tiles = (rows + tile_rows - 1) / tile_rows;
        int64_t end = tiles * (thread + 1) / threads * tile_rows;
        share.row_begin = tiles * thread / threads * tile_rows;
        share.row_end = end < rows ? end : rows;
    }
    return share;
}

#if defined(__AVX512F__)
/* e^x for 16 floats: 2^n * e^r with |r| <= ln2 / 2, e^r by its degree-6 Taylor polynomial
 * (relative error ~2e-7). */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-100.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* x / (1 + e^-x) for 16 floats; 0 where e^-x overflows (x below -88.7: x / inf). The same bits
 * under any build options (the W8A8 matmul's epilogue is built without contraction or
 * reassociation, the row kernels with both): only explicit FMAs, and the result is held as it
 * is, so a caller's silu * up is never reassociated into x * up * (1 / d). */
static inline __m512 silu16(__m512 x) {
    __m512 denominator = _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), x)));
    /* 1 / d: a 14-bit estimate and one Newton step (~1 ulp), far cheaper than a division; its
     * inf * 0 would make an overflowed d's lanes NaN, so those take 0. */
    __mmask16 finite = _mm512_cmp_ps_mask(denominator, _mm512_set1_ps(INFINITY), _CMP_LT_OQ);
    __m512 estimate = _mm512_rcp14_ps(denominator);
    estimate = _mm512_maskz_mul_ps(finite, estimate, _mm512_fnmadd_ps(denominator, estimate, _mm512_set1_ps(2.0f)));
    __m512 silu = _mm512_mul_ps(x, estimate);
    __asm__("" : "+v"(silu));
    return silu;
}
#endif

#if defined(__AMX_TILE__)
/* The LDTILECFG operand: palette 1, each tile's rows and bytes per row. */
typedef struct {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* All eight tiles at their full 16 rows of 64 bytes, for this thread (each thread configures its
 * own tiles and releases them when done). */
static inline void configure_full_tiles(void) {
    TileConfig config;
    memset(&config, 0, sizeof config);
    config.palette_id = 1;
    for (int tile = 0; tile < 8; tile++) {
        config.rows[tile] = 16;
        config.colsb[tile] = 64;
    }
    _tile_loadconfig(&config);
}
#endif

/* Row kernels of row_kernels.c that the decode step reuses; each returns 0 when out of memory. */
#define FT_INTERNAL __attribute__((visibility("hidden")))
FT_INTERNAL float row_inverse_rms(const float *x, int64_t cols, float eps);
FT_INTERNAL void normalize_row(const float *x, const float *weight, int64_t cols, float eps, int dtype, float *out);
/* Row r of SwiGLU's product to_dtype(to_dtype(silu(gate)) * up), from gate_up [rows, 2 * half],
 * into `product` [half] (float32 holding the dtype's values). */
FT_INTERNAL void silu_and_mul_row(const void *gate_up, int64_t r, int64_t half, int dtype, float *product);
FT_INTERNAL int rms_norm_rows(const void *x, const void *weight, void *out, int64_t begin, int64_t end, int64_t cols,
                              float eps, int dtype);
FT_INTERNAL void add_residual_row(const void *x, const void *residual, int64_t r, int64_t cols, int dtype, float *row,
                                  float *residual_row, void *summed);
FT_INTERNAL int add_rms_norm_rows(const void *x, const void *residual, const void *weight, void *out, void *summed,
                                  int64_t begin, int64_t end, int64_t cols, float eps, int dtype);
FT_INTERNAL int silu_and_mul_rows(const void *gate_up, void *out, int64_t begin, int64_t end, int64_t half, int dtype);
FT_INTERNAL int rotary_rows(void *x, int64_t row_stride, int64_t begin, int64_t end, int64_t heads, int64_t head_dim,
                            const void *cos, const void *sin, int dtype);

#endif
