/* W8A8 projections on x86 CPUs without exact int8 dot products in oneDNN (AVX2 without VNNI:
 * Zen 2/3, Haswell to Comet Lake; AVX-512 without VNNI: Skylake-SP). There oneDNN adds pairs of
 * byte products in saturating 16-bit lanes (VPMADDUBSW), which full-range levels overflow.
 *
 * Here both operands are widened to int16 and VPMADDWD multiplies pairs of them into exact
 * int32 sums (|level| <= 127: a pair's sum is far inside int32, and so is a row's whole sum for
 * any in_features below 130,000). One VPMADDWD does 16 multiply-adds where a float32 FMA does 8,
 * with the weights read at 2 bytes instead of 4.
 *
 * Weights are packed once at load into panels of PANEL_COLUMNS outputs, their inputs in pairs:
 * [panels][in_pairs][PANEL_COLUMNS][2] int16, so one 256-bit load holds 8 outputs' weights for
 * inputs 2p and 2p + 1, and one broadcast of a row's two levels meets them. Each call widens its
 * activation levels (the uint8 of `ft_quantize_rows_int8`, level + 128) once.
 *
 * The integer sums are exact whatever the tiling and thread count, and the scaling after them
 * runs per element: (float)sum * weight_scale * row_scale (+ bias), rounded once to the output
 * dtype (the order of oneDNN's product followed by `ft_rescale_rows`). A row's result depends
 * on its own inputs only.
 */
#pragma GCC optimize("no-associative-math")
#include "common.h"

#if defined(__AVX2__)
#include <immintrin.h>

#define PANEL_COLUMNS 16
#define TILE_ROWS 6
/* A block of rows (their widened levels: 96 rows x 1536 inputs = 288 KiB) stays in L2 while
 * every panel meets it. */
#define ROW_BLOCK (16 * TILE_ROWS)

typedef struct {
    const int16_t *activations; /* [rows][2 * in_pairs] */
    const float *row_scales;
    const int16_t *weight; /* packed */
    const float *weight_scales;
    const float *bias; /* [out_features] or NULL */
    int64_t rows;
    int64_t out_features;
    int64_t in_pairs;
    void *out;
    int dtype;
} W8A8Matmul;

int ft_w8a8_panel_columns(void) {
    return PANEL_COLUMNS;
}

/* int8 levels [out_features, in_features] into the panel layout above (zero-padded to whole
 * panels and input pairs): packed holds panels * in_pairs * PANEL_COLUMNS * 2 int16. */
FtStatus ft_pack_w8a8_weight(const int8_t *weight, int64_t out_features, int64_t in_features, int16_t *packed) {
    int64_t pairs = (in_features + 1) / 2, panels = (out_features + PANEL_COLUMNS - 1) / PANEL_COLUMNS;
    for (int64_t panel = 0; panel < panels; panel++) {
        for (int64_t pair = 0; pair < pairs; pair++) {
            int16_t *destination = packed + (panel * pairs + pair) * PANEL_COLUMNS * 2;
            for (int64_t column = 0; column < PANEL_COLUMNS; column++) {
                int64_t o = panel * PANEL_COLUMNS + column;
                for (int64_t j = 0; j < 2; j++) {
                    int64_t k = 2 * pair + j;
                    destination[column * 2 + j] = o < out_features && k < in_features ? weight[o * in_features + k] : 0;
                }
            }
        }
    }
    return FT_OK;
}

static inline __attribute__((always_inline)) void store_tile_row(const W8A8Matmul *m, __m256i sums[2], int64_t row,
                                                                 int64_t column, int64_t cols) {
    float values[PANEL_COLUMNS];
    float row_scale = m->row_scales[row];
    for (int v = 0; v < 2; v++) {
        _mm256_storeu_ps(values + 8 * v, _mm256_cvtepi32_ps(sums[v]));
    }
    for (int64_t c = 0; c < cols; c++) {
        float value = values[c] * m->weight_scales[column + c] * row_scale;
        if (m->bias != NULL) {
            value += m->bias[column + c];
        }
        int64_t index = row * m->out_features + column + c;
        if (m->dtype == DTYPE_BFLOAT16) {
            ((uint16_t *)m->out)[index] = float_to_bf16(value);
        } else {
            ((float *)m->out)[index] = value;
        }
    }
}

/* `rows` rows (a compile-time constant where inlined) by one panel. */
static inline __attribute__((always_inline)) void multiply_tile(const int rows, const W8A8Matmul *m, int64_t row,
                                                                int64_t panel) {
    __m256i sums[TILE_ROWS][2];
    for (int r = 0; r < rows; r++) {
        sums[r][0] = sums[r][1] = _mm256_setzero_si256();
    }
    const int16_t *weight = m->weight + panel * m->in_pairs * PANEL_COLUMNS * 2;
    const int16_t *x = m->activations + row * 2 * m->in_pairs;
    for (int64_t pair = 0; pair < m->in_pairs; pair++) {
        __m256i low = _mm256_loadu_si256((const __m256i *)(weight + pair * PANEL_COLUMNS * 2));
        __m256i high = _mm256_loadu_si256((const __m256i *)(weight + pair * PANEL_COLUMNS * 2 + 16));
#pragma GCC unroll 8
        for (int r = 0; r < rows; r++) {
            int32_t levels;
            memcpy(&levels, x + r * 2 * m->in_pairs + 2 * pair, sizeof levels);
            __m256i broadcast = _mm256_set1_epi32(levels);
            sums[r][0] = _mm256_add_epi32(sums[r][0], _mm256_madd_epi16(broadcast, low));
            sums[r][1] = _mm256_add_epi32(sums[r][1], _mm256_madd_epi16(broadcast, high));
        }
    }
    int64_t column = panel * PANEL_COLUMNS;
    int64_t cols = m->out_features - column < PANEL_COLUMNS ? m->out_features - column : PANEL_COLUMNS;
    for (int r = 0; r < rows; r++) {
        store_tile_row(m, sums[r], row + r, column, cols);
    }
}

static void multiply_rows(int rows, const W8A8Matmul *m, int64_t row, int64_t panel) {
    switch (rows) {
    case 1: multiply_tile(1, m, row, panel); break;
    case 2: multiply_tile(2, m, row, panel); break;
    case 3: multiply_tile(3, m, row, panel); break;
    case 4: multiply_tile(4, m, row, panel); break;
    case 5: multiply_tile(5, m, row, panel); break;
    case 6: multiply_tile(6, m, row, panel); break;
    }
}

static void multiply_block(const W8A8Matmul *m, int64_t row_begin, int64_t row_end, int64_t panel_begin,
                           int64_t panel_end) {
    for (int64_t block = row_begin; block < row_end; block += ROW_BLOCK) {
        int64_t block_end = block + ROW_BLOCK < row_end ? block + ROW_BLOCK : row_end;
        for (int64_t panel = panel_begin; panel < panel_end; panel++) {
            for (int64_t row = block; row < block_end; row += TILE_ROWS) {
                int rows = block_end - row < TILE_ROWS ? (int)(block_end - row) : TILE_ROWS;
                multiply_rows(rows, m, row, panel);
            }
        }
    }
}

/* Rows [begin, end) of uint8 levels (level + 128) [rows, in_features] as int16 levels, each row
 * zero-padded to 2 * in_pairs. */
static void widen_levels(const uint8_t *levels, int64_t begin, int64_t end, int64_t in_features, int64_t in_pairs,
                         int16_t *widened) {
    for (int64_t r = begin; r < end; r++) {
        int16_t *destination = widened + r * 2 * in_pairs;
        for (int64_t k = 0; k < in_features; k++) {
            destination[k] = (int16_t)((int16_t)levels[r * in_features + k] - 128);
        }
        if (in_features % 2 != 0) {
            destination[in_features] = 0;
        }
    }
}

/* out [rows, out_features] in `dtype` = the W8A8 product of uint8 activation levels (level + 128)
 * [rows, in_features] with their row_scales [rows] and the packed int8 weights (ft_pack_w8a8_weight)
 * with their weight_scales [out_features], plus float32 bias [out_features] unless NULL. */
FtStatus ft_w8a8_matmul(const uint8_t *levels, const float *row_scales, const int16_t *weight,
                        const float *weight_scales, const float *bias, void *out, int64_t rows, int64_t out_features,
                        int64_t in_features, int dtype, int num_threads) {
    int64_t in_pairs = (in_features + 1) / 2;
    int16_t *activations = malloc((size_t)(rows * 2 * in_pairs) * sizeof(int16_t));
    if (activations == NULL) {
        return FT_OUT_OF_MEMORY;
    }
    W8A8Matmul m = {activations, row_scales, weight, weight_scales, bias, rows, out_features, in_pairs, out, dtype};
    int64_t panels = (out_features + PANEL_COLUMNS - 1) / PANEL_COLUMNS;
    int parallel = rows * out_features * in_features >= PARALLEL_MIN_ELEMENTS * 16 && num_threads > 1;
#pragma omp parallel num_threads(num_threads) if (parallel)
    {
        int64_t threads = omp_get_num_threads(), thread = omp_get_thread_num();
        int64_t begin, end;
        thread_rows(rows, &begin, &end);
        widen_levels(levels, begin, end, in_features, in_pairs, activations);
#pragma omp barrier
        if (panels >= 4 * threads || rows < 2 * TILE_ROWS * threads) {
            thread_rows(panels, &begin, &end);
            multiply_block(&m, 0, rows, begin, end);
        } else {
            int64_t tiles = (rows + TILE_ROWS - 1) / TILE_ROWS;
            int64_t tile_begin = tiles * thread / threads * TILE_ROWS;
            int64_t tile_end = tiles * (thread + 1) / threads * TILE_ROWS;
            multiply_block(&m, tile_begin, tile_end < rows ? tile_end : rows, 0, panels);
        }
    }
    free(activations);
    return FT_OK;
}
#endif
