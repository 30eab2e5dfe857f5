/* W8A8 projections in the native kernels, with the scaling fused after the integer sums.
 *
 * On CPUs with AVX512-VNNI (Cascade Lake, Ice Lake, Zen 4 and later) VPDPBUSD multiplies the
 * uint8 activation levels (level + 128, as `ft_quantize_rows_int8` writes them) by the int8
 * weights four pairs at a time into int32 sums, which are exact: the +128 is taken off each sum
 * as 128 times its output's weight sum, computed once at packing. Weights are packed as
 * [panels][in_quads][VNNI_PANEL_COLUMNS][4] int8, one 64-byte vector per 16 outputs and four
 * inputs, then each panel column's compensation (int32). oneDNN's int8 matmul sums as exactly there,
 * but writes float32 rows that a second pass must scale by the rows' scales and round; here that
 * happens while the sums are in registers. SwiGLU's gate | up projection can go further (packed
 * `silu_gated`): each panel pairs 16 features' gates with their ups, and the epilogue stores
 * silu(gate) * up, so the gate | up rows are never written and read back.
 *
 * On x86 CPUs without exact int8 dot products in oneDNN (AVX2 without VNNI: Zen 2/3, Haswell to
 * Comet Lake; AVX-512 without VNNI: Skylake-SP) oneDNN adds pairs of byte products in saturating
 * 16-bit lanes (VPMADDUBSW), which full-range levels overflow. There both operands are widened to
 * int16 and VPMADDWD multiplies pairs of them into exact int32 sums (|level| <= 127: a pair's sum
 * is far inside int32, and so is a row's whole sum for any in_features below 130,000). One
 * VPMADDWD does 16 multiply-adds where a float32 FMA does 8, with the weights read at 2 bytes
 * instead of 4. Weights are packed as [panels][in_pairs][PANEL_COLUMNS][2] int16, so one 256-bit
 * load holds 8 outputs' weights for inputs 2p and 2p + 1, and one broadcast of a row's two levels
 * meets them. Each call widens its activation levels once.
 *
 * On CPUs with AMX-INT8 (Sapphire Rapids and later) the same packed weights are B tiles as they
 * lie: 16 input quads of a panel's first or last 16 outputs, rows 128 bytes apart. TDPBUSD
 * multiplies 32 rows (two A tiles of 16 rows by 64 inputs, read from the levels in place) by a
 * panel into four int32 C tiles; stored to the stack, they meet the compensation and the scaling
 * of the VNNI path while they are in L1 (for SwiGLU's and long products, while the tile unit
 * sums the next tile). A thread's share of more than 512 rows (a long prefill's)
 * goes in blocks of 32 rows, each meeting every panel of the share before the next block: its
 * levels stay in L1 and the panels stream in from L2. A share of up to 512 rows (a decode step's,
 * a short prompt's) goes panel by panel instead, each panel meeting all its tiles of rows while it
 * is in L1: the panels, which a step reads from L3 or memory, are read once, where blocks of rows
 * read them once per block (48 to 512 rows: 0.73-0.93x the time over 30 layers of distinct weights).
 * Rows past the last whole 32 are copied, zero rows after them, into one tile of their own, so
 * every tile is a full one; a call of fewer than 32 rows takes tiles configured to that many.
 * Inputs that are not whole 64-byte tile rows take the VNNI kernel.
 *
 * Either way the integer sums are exact whatever the tiling and thread count, and the scaling
 * after them runs per element: (float)sum * weight_scale * row_scale (+ bias), each step rounded
 * (the build is ISO C: no fused multiply-add), then once to the output dtype: the order of
 * oneDNN's product followed by `ft_rescale_rows`. A row's result depends on its own inputs only.
 */
#pragma GCC optimize("no-associative-math")
#include "common.h"

/* Whether a product is worth waking the other threads for: the weights' bytes, as the quantized
 * matmuls judge it, or the products. A decode step's few rows still stream every weight from
 * memory, which two cores read faster than one (SmolLM2's qkv_proj, o_proj and down_proj for one
 * row stayed on one thread under the products' count alone). */
static inline int worth_threads(int64_t rows, int64_t out_features, int64_t in_features) {
    return out_features * in_features >= 4 * PARALLEL_MIN_ELEMENTS
           || rows * out_features * in_features >= 16 * PARALLEL_MIN_ELEMENTS;
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>

#define VNNI_VECTORS 2
#define PANEL_COLUMNS (16 * VNNI_VECTORS)
#define TILE_ROWS 12
/* Rows a thread takes through every panel before the next block: their levels (96 rows x 1536
 * inputs = 144 KiB) stay in L2 while each panel (32 outputs x 1536 inputs = 48 KiB) meets them. */
#define ROW_BLOCK (8 * TILE_ROWS)

typedef struct {
    const uint8_t *activations; /* [rows][4 * in_quads] */
    const float *row_scales;
    const int8_t *weight; /* packed */
    const int32_t *compensation; /* [panels * PANEL_COLUMNS]: 128 * each output's weight sum */
    const float *weight_scales;
    const float *bias; /* [out_features] or NULL */
    int64_t rows;
    int64_t out_features;
    int64_t in_quads;
    void *out;
    int dtype;
    int use_amx; /* full 32-row tiles on AMX-INT8 */
    /* On AMX, for more than 32 rows not a multiple of 32: rows [tail_row, rows) padded with zero
     * rows to one tile [AMX_TILE_ROWS][4 * in_quads], read in place of the levels; else NULL. */
    const uint8_t *tail_levels;
    int64_t tail_row;
    int silu_gated; /* panels pair gates with ups (ft_pack_w8a8_weight); out is SwiGLU's product */
} W8A8Matmul;

static int64_t vnni_panels(int64_t out_features) {
    return (out_features + PANEL_COLUMNS - 1) / PANEL_COLUMNS;
}

int ft_w8a8_uses_vnni(void) {
    return 1;
}

int64_t ft_w8a8_packed_bytes(int64_t out_features, int64_t in_features) {
    int64_t columns = vnni_panels(out_features) * PANEL_COLUMNS;
    return columns * ((in_features + 3) / 4) * 4 + columns * (int64_t)sizeof(int32_t);
}

/* The output (weight row) a panel's column holds: in order, or where silu_gated, the panel's
 * first 16 columns 16 gates and its last 16 the ups of the same features (gate | up halves of
 * out_features); -1 for padding. */
static int64_t panel_column_output(int64_t panel, int64_t column, int64_t out_features, int silu_gated) {
    if (!silu_gated) {
        int64_t o = panel * PANEL_COLUMNS + column;
        return o < out_features ? o : -1;
    }
    int64_t half = out_features / 2, feature = panel * 16 + column % 16;
    return feature < half ? feature + (column / 16) * half : -1;
}

/* int8 levels [out_features, in_features] into the panel layout above (zero-padded to whole
 * panels and input quads), followed by each panel column's compensation. */
FtStatus ft_pack_w8a8_weight(const int8_t *weight, int64_t out_features, int64_t in_features, int silu_gated,
                             void *packed) {
    if (silu_gated && out_features % 2 != 0) {
        return FT_BAD_SHAPE;
    }
    int64_t quads = (in_features + 3) / 4, panels = vnni_panels(out_features);
    int8_t *levels = packed;
    int32_t *compensation = (int32_t *)(levels + panels * PANEL_COLUMNS * quads * 4);
    for (int64_t panel = 0; panel < panels; panel++) {
        for (int64_t column = 0; column < PANEL_COLUMNS; column++) {
            int64_t o = panel_column_output(panel, column, out_features, silu_gated);
            int32_t sum = 0;
            for (int64_t k = 0; k < quads * 4; k++) {
                int8_t level = o >= 0 && k < in_features ? weight[o * in_features + k] : 0;
                levels[((panel * quads + k / 4) * PANEL_COLUMNS + column) * 4 + k % 4] = level;
                sum += level;
            }
            compensation[panel * PANEL_COLUMNS + column] = 128 * sum;
        }
    }
    return FT_OK;
}

/* A panel's scaling constants, held in registers while its rows are scaled: loaded once per
 * panel and tile, where reading them through the call's struct after each store would reload
 * them (the stores may alias anything). */
typedef struct {
    __m512i compensation[VNNI_VECTORS];
    __m512 weight_scales[VNNI_VECTORS];
    __m512 bias[VNNI_VECTORS];
    __mmask16 masks[VNNI_VECTORS];
    int vectors; /* those holding outputs below out_features */
    int has_bias;
    int silu_gated;
    int64_t row_stride; /* the output's elements per row */
    void *out; /* the panel's first column of output row 0 */
} PanelScaling;

static inline __attribute__((always_inline)) PanelScaling panel_scaling(const W8A8Matmul *m, int64_t panel_index) {
    PanelScaling panel = {.vectors = 0, .has_bias = m->bias != NULL, .silu_gated = m->silu_gated};
    /* Where silu_gated, the panel's 16 features' gates (weight rows `feature`) and ups
     * (`half + feature`) make 16 product columns. */
    int64_t half = m->out_features / 2;
    panel.row_stride = m->silu_gated ? half : m->out_features;
    int64_t out_column = m->silu_gated ? panel_index * 16 : panel_index * PANEL_COLUMNS;
    panel.out = m->dtype == DTYPE_BFLOAT16 ? (void *)((uint16_t *)m->out + out_column)
                                           : (void *)((float *)m->out + out_column);
    for (int v = 0; v < VNNI_VECTORS; v++) {
        int64_t first = m->silu_gated ? v * half + out_column : out_column + 16 * v;
        int64_t valid = m->silu_gated ? half - out_column : m->out_features - first;
        valid = valid < 0 ? 0 : valid;
        panel.masks[v] = valid >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << valid) - 1u);
        panel.vectors += valid > 0;
        panel.compensation[v] = _mm512_loadu_si512(m->compensation + panel_index * PANEL_COLUMNS + 16 * v);
        panel.weight_scales[v] = _mm512_maskz_loadu_ps(panel.masks[v], m->weight_scales + first);
        panel.bias[v] = panel.has_bias ? _mm512_maskz_loadu_ps(panel.masks[v], m->bias + first) : _mm512_setzero_ps();
    }
    return panel;
}

/* float32 lanes rounded to nearest even bf16, as float_to_bf16 (the values are finite: exact
 * sums times finite scales). */
static inline __attribute__((always_inline)) __m256i round_to_bf16(__m512 value) {
#if defined(__AVX512BF16__)
    return (__m256i)_mm512_cvtneps_pbh(value);
#else
    __m512i bits = _mm512_castps_si512(value);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    bits = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
    return _mm512_cvtepi32_epi16(bits);
#endif
}

/* Each lane rounded to bf16's values, kept in float32. */
static inline __attribute__((always_inline)) __m512 bf16_lanes(__m512 value) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(round_to_bf16(value)), 16));
}

/* silu(gate) * up as ft_silu_and_mul makes it from the product's gate | up row in `dtype` (a
 * constant where inlined): for bf16, gate and up as stored, silu and the product each rounded. */
static inline __attribute__((always_inline)) __m512 swiglu_lanes(const int dtype, __m512 gate, __m512 up) {
    if (dtype == DTYPE_BFLOAT16) {
        return _mm512_mul_ps(bf16_lanes(silu16(bf16_lanes(gate))), bf16_lanes(up));
    }
    return _mm512_mul_ps(silu16(gate), up);
}

/* One row of a panel from its exact sums (before compensation): (float)sum * weight_scale *
 * row_scale (+ bias), stored in `dtype` (a constant where inlined), or where silu_gated their
 * SwiGLU product; lanes past the outputs are left alone. */
static inline __attribute__((always_inline)) void store_panel_row(const PanelScaling *panel, const int dtype,
                                                                  const __m512i sums[VNNI_VECTORS], float row_scale,
                                                                  int64_t row) {
    __m512 scale = _mm512_set1_ps(row_scale), values[VNNI_VECTORS];
    for (int v = 0; v < panel->vectors; v++) {
        __m512 value = _mm512_cvtepi32_ps(_mm512_sub_epi32(sums[v], panel->compensation[v]));
        values[v] = _mm512_mul_ps(_mm512_mul_ps(value, panel->weight_scales[v]), scale);
        if (panel->has_bias) {
            values[v] = _mm512_add_ps(values[v], panel->bias[v]);
        }
    }
    int stored = panel->vectors;
    if (panel->silu_gated && stored > 0) {
        values[0] = swiglu_lanes(dtype, values[0], values[1]);
        stored = 1;
    }
    for (int v = 0; v < stored; v++) {
        int64_t index = row * panel->row_stride + 16 * v;
        if (dtype == DTYPE_BFLOAT16) {
            _mm256_mask_storeu_epi16((uint16_t *)panel->out + index, panel->masks[v], round_to_bf16(values[v]));
        } else {
            _mm512_mask_storeu_ps((float *)panel->out + index, panel->masks[v], values[v]);
        }
    }
}

/* acc + the four u8 x s8 products of each int32 lane. In assembly so the accumulator stays in
 * its register: GCC moves and spills the intrinsic's result each step (2.4x slower). */
static inline __attribute__((always_inline)) __m512i dot_quads(__m512i acc, __m512i activations, __m512i weights) {
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(activations), "v"(weights));
    return acc;
}

/* `rows` rows (a compile-time constant where inlined) by one panel. */
static inline __attribute__((always_inline)) void multiply_tile(const int rows, const W8A8Matmul *m, int64_t row,
                                                            int64_t panel) {
    __m512i sums[TILE_ROWS][VNNI_VECTORS];
    for (int r = 0; r < rows; r++) {
        for (int v = 0; v < VNNI_VECTORS; v++) {
            sums[r][v] = _mm512_setzero_si512();
        }
    }
    const int8_t *weight = m->weight + panel * m->in_quads * PANEL_COLUMNS * 4;
    const uint8_t *x = m->activations + row * 4 * m->in_quads;
    for (int64_t quad = 0; quad < m->in_quads; quad++) {
        __m512i weights[VNNI_VECTORS];
        for (int v = 0; v < VNNI_VECTORS; v++) {
            weights[v] = _mm512_loadu_si512(weight + (quad * PANEL_COLUMNS + 16 * v) * 4);
            /* Held in a register: GCC would otherwise load it again before each row's products. */
            __asm__("" : "+v"(weights[v]));
        }
#pragma GCC unroll 12
        for (int r = 0; r < rows; r++) {
            int32_t levels;
            memcpy(&levels, x + r * 4 * m->in_quads + 4 * quad, sizeof levels);
            __m512i broadcast = _mm512_set1_epi32(levels);
            for (int v = 0; v < VNNI_VECTORS; v++) {
                sums[r][v] = dot_quads(sums[r][v], broadcast, weights[v]);
            }
        }
    }
    PanelScaling scaling = panel_scaling(m, panel);
    const float *row_scales = m->row_scales;
    int dtype = m->dtype;
    for (int r = 0; r < rows; r++) {
        if (dtype == DTYPE_BFLOAT16) {
            store_panel_row(&scaling, DTYPE_BFLOAT16, sums[r], row_scales[row + r], row + r);
        } else {
            store_panel_row(&scaling, DTYPE_FLOAT32, sums[r], row_scales[row + r], row + r);
        }
    }
}

#define TILE_CASE(count)                                                                                         \
    case count: multiply_tile(count, m, row, panel); break;

static void multiply_rows(int rows, const W8A8Matmul *m, int64_t row, int64_t panel) {
    switch (rows) {
        TILE_CASES_1_TO_6(TILE_CASE)
        TILE_CASES_7_TO_12(TILE_CASE)
    }
}

#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define W8A8_AMX 1
#define AMX_TILE_ROWS 32 /* two A tiles */
#define AMX_STEP_QUADS 16 /* input quads per A tile row (64 bytes) */
/* Rows a thread takes through every panel before the next block on AMX: one block of tiles,
 * whose levels (32 rows x 576 inputs = 18 KiB) stay in L1 while each panel streams in from L2
 * (SmolLM2's projections: 0.90-0.96x the time of 96-row blocks, whose levels left L1). */
#define AMX_ROW_BLOCK AMX_TILE_ROWS
/* The most rows of a thread's share that go panel by panel, every tile of rows meeting a panel
 * at once: their levels (512 x 1536 inputs = 768 KiB) stay in L2. */
#define PANEL_FIRST_SHARE_ROWS (16 * AMX_TILE_ROWS)
/* Products of whole tiles whose tiles are scaled while the next tile's sums run: SwiGLU's,
 * whose scaling (the silu) takes longer than its tile's TDPBUSDs, and those of at least this many
 * input quads (1024 inputs: down_proj's), whose long sums leave room for it. SmolLM2's
 * gate_up_proj and down_proj took 0.87-0.96x and 0.84-0.89x the time at 48, 512 and 2048 rows;
 * scaling a 576-input product's rows meanwhile made qkv_proj and o_proj up to 1.4x slower (their
 * output stores, which miss, hold up the C tiles' stores behind them), and a call of one row
 * (one tile per panel) 1.05-1.08x. */
#define OVERLAP_MIN_QUADS 256

int ft_w8a8_has_amx(void) {
    return 1;
}

/* A block of up to 32 rows' int32 sums of one panel, stored from the C tiles, waiting to be scaled. */
typedef struct {
    int32_t sums[AMX_TILE_ROWS][PANEL_COLUMNS] __attribute__((aligned(64)));
    int64_t row;
    int64_t panel;
    int rows;
} TileSums;

/* This thread's tiles for blocks of `rows` rows (1..32): A tile 4 and C tiles 0-1 hold the first
 * 16, A tile 5 and C tiles 2-3 the rest (unconfigured, and unused, for 16 or fewer); B tiles 6-7
 * 16 input quads of 16 outputs. */
static void configure_row_tiles(int rows) {
    TileConfig config;
    memset(&config, 0, sizeof config);
    config.palette_id = 1;
    int first = rows < 16 ? rows : 16, second = rows - first;
    static const int first_tiles[] = {0, 1, 4}, second_tiles[] = {2, 3, 5}, weight_tiles[] = {6, 7};
    for (int i = 0; i < 3; i++) {
        config.rows[first_tiles[i]] = (uint8_t)first;
        config.colsb[first_tiles[i]] = 64;
        config.rows[second_tiles[i]] = (uint8_t)second;
        config.colsb[second_tiles[i]] = second > 0 ? 64 : 0;
    }
    for (int i = 0; i < 2; i++) {
        config.rows[weight_tiles[i]] = 16;
        config.colsb[weight_tiles[i]] = 64;
    }
    _tile_loadconfig(&config);
}

/* Rows [begin, end) of a stored tile's outputs in `dtype` (a constant where inlined), as
 * `multiply_tile` stores its own; `scaling` is the tile's panel's. */
static inline __attribute__((always_inline)) void scale_tile_rows(const int dtype, const W8A8Matmul *m,
                                                                  const PanelScaling *scaling, const TileSums *tile,
                                                                  int begin, int end) {
    const float *row_scales = m->row_scales;
    for (int r = begin; r < end; r++) {
        __m512i sums[VNNI_VECTORS];
        for (int v = 0; v < VNNI_VECTORS; v++) {
            sums[v] = _mm512_load_si512(tile->sums[r] + 16 * v);
        }
        store_panel_row(scaling, dtype, sums, row_scales[tile->row + r], tile->row + r);
    }
}

/* Rows [row, row + rows) by one panel (tiles configured for `rows`) on tiles 0-3 (C), 4-5 (A:
 * rows), 6-7 (B: the panel's halves), into `out`. Where `previous` is not NULL the vector units
 * scale that earlier tile's rows meanwhile, a few after each step's TDPBUSDs, while the tile
 * unit works through them. */
static inline __attribute__((always_inline)) void amx_multiply_tile(const int dtype, const W8A8Matmul *m,
                                                                    int64_t row, int rows, int64_t panel,
                                                                    TileSums *out, const TileSums *previous) {
    int64_t row_bytes = 4 * m->in_quads, panel_row_bytes = 4 * PANEL_COLUMNS;
    const int8_t *weight = m->weight + panel * m->in_quads * panel_row_bytes;
    const uint8_t *x = m->tail_levels != NULL && row == m->tail_row ? m->tail_levels
                                                                    : m->activations + row * row_bytes;
    int second_half = rows > 16;
    int64_t steps = m->in_quads / AMX_STEP_QUADS;
    int scaled = 0, previous_rows = previous != NULL ? previous->rows : 0;
    int rows_per_step = steps > 0 ? (int)((previous_rows + steps - 1) / steps) : previous_rows;
    PanelScaling previous_scaling = {0};
    if (previous != NULL) {
        previous_scaling = panel_scaling(m, previous->panel);
    }
    _tile_zero(0);
    _tile_zero(1);
    if (second_half) {
        _tile_zero(2);
        _tile_zero(3);
    }
    for (int64_t quad = 0; quad < m->in_quads; quad += AMX_STEP_QUADS) {
        _tile_loadd(4, x + 4 * quad, row_bytes);
        _tile_loadd(6, weight + quad * panel_row_bytes, panel_row_bytes);
        _tile_loadd(7, weight + quad * panel_row_bytes + 64, panel_row_bytes);
        _tile_dpbusd(0, 4, 6);
        _tile_dpbusd(1, 4, 7);
        if (second_half) {
            _tile_loadd(5, x + 16 * row_bytes + 4 * quad, row_bytes);
            _tile_dpbusd(2, 5, 6);
            _tile_dpbusd(3, 5, 7);
        }
        if (scaled < previous_rows) {
            int until = scaled + rows_per_step < previous_rows ? scaled + rows_per_step : previous_rows;
            scale_tile_rows(dtype, m, &previous_scaling, previous, scaled, until);
            scaled = until;
        }
    }
    if (scaled < previous_rows) {
        scale_tile_rows(dtype, m, &previous_scaling, previous, scaled, previous_rows);
    }
    _tile_stored(0, out->sums[0], panel_row_bytes);
    _tile_stored(1, out->sums[0] + 16, panel_row_bytes);
    if (second_half) {
        _tile_stored(2, out->sums[16], panel_row_bytes);
        _tile_stored(3, out->sums[16] + 16, panel_row_bytes);
    }
    out->row = row;
    out->panel = panel;
    out->rows = rows;
}

/* A tile's sums and, 2 KiB past them, the other buffer's: the vector units read one while the
 * tile unit stores the other, and buffers 4 KiB apart would alias in the store buffer (the loads
 * wait on the stores at the same offset). */
typedef struct {
    TileSums tile;
    char apart[2048];
} TileBuffer;

/* Rows [row_begin, row_end) by panels [panel_begin, panel_end) as multiply_block walks them: blocks
 * of `row_block` rows, each meeting every panel in tiles of 32 rows. Where `overlapped`, each
 * tile's sums are scaled while the tile unit sums the next tile's; else after they are stored. */
static inline __attribute__((always_inline)) void amx_multiply_block_as(const int dtype, const W8A8Matmul *m,
                                                                        int64_t row_begin, int64_t row_end,
                                                                        int64_t panel_begin, int64_t panel_end,
                                                                        int64_t row_block, int overlapped) {
    TileBuffer buffers[2];
    const TileSums *previous = NULL;
    int current = 0;
    for (int64_t block = row_begin; block < row_end; block += row_block) {
        int64_t block_end = block + row_block < row_end ? block + row_block : row_end;
        for (int64_t panel = panel_begin; panel < panel_end; panel++) {
            for (int64_t row = block; row < block_end; row += AMX_TILE_ROWS) {
                int rows = block_end - row < AMX_TILE_ROWS ? (int)(block_end - row) : AMX_TILE_ROWS;
                TileSums *tile = &buffers[current].tile;
                amx_multiply_tile(dtype, m, row, rows, panel, tile, previous);
                if (overlapped) {
                    previous = tile;
                    current ^= 1;
                } else {
                    PanelScaling scaling = panel_scaling(m, panel);
                    scale_tile_rows(dtype, m, &scaling, tile, 0, rows);
                }
            }
        }
    }
    if (previous != NULL) {
        PanelScaling scaling = panel_scaling(m, previous->panel);
        scale_tile_rows(dtype, m, &scaling, previous, 0, previous->rows);
    }
}

/* amx_multiply_block_as for the call's dtype. */
static void amx_multiply_block(const W8A8Matmul *m, int64_t row_begin, int64_t row_end, int64_t panel_begin,
                               int64_t panel_end, int64_t row_block, int overlapped) {
    if (m->dtype == DTYPE_BFLOAT16) {
        amx_multiply_block_as(DTYPE_BFLOAT16, m, row_begin, row_end, panel_begin, panel_end, row_block, overlapped);
    } else {
        amx_multiply_block_as(DTYPE_FLOAT32, m, row_begin, row_end, panel_begin, panel_end, row_block, overlapped);
    }
}
#endif

/* Rows [begin, end) of uint8 levels [rows, in_features] with each row zero-padded to whole
 * quads (the padding meets zero weights). */
static void pad_levels(const uint8_t *levels, int64_t begin, int64_t end, int64_t in_features, int64_t in_quads,
                       uint8_t *padded) {
    for (int64_t r = begin; r < end; r++) {
        memcpy(padded + r * 4 * in_quads, levels + r * in_features, (size_t)in_features);
        memset(padded + r * 4 * in_quads + in_features, 0, (size_t)(4 * in_quads - in_features));
    }
}

#elif defined(__AVX2__)
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

int ft_w8a8_uses_vnni(void) {
    return 0;
}

int64_t ft_w8a8_packed_bytes(int64_t out_features, int64_t in_features) {
    int64_t panels = (out_features + PANEL_COLUMNS - 1) / PANEL_COLUMNS;
    return panels * ((in_features + 1) / 2) * PANEL_COLUMNS * 2 * (int64_t)sizeof(int16_t);
}

/* int8 levels [out_features, in_features] into the panel layout above (zero-padded to whole
 * panels and input pairs): packed holds panels * in_pairs * PANEL_COLUMNS * 2 int16. This
 * build's epilogue does not make SwiGLU's product: silu_gated is refused. */
FtStatus ft_pack_w8a8_weight(const int8_t *weight, int64_t out_features, int64_t in_features, int silu_gated,
                             void *packed_weight) {
    if (silu_gated) {
        return FT_BAD_SHAPE;
    }
    int16_t *packed = packed_weight;
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

/* Eight outputs at out[index] from their exact sums: (float)sum * weight_scale * row_scale
 * (+ bias), in the output dtype (bf16 rounded to nearest even, as float_to_bf16: the values are
 * finite). */
static inline __attribute__((always_inline)) void store_eight(const W8A8Matmul *m, __m256i sums, __m256 row_scale,
                                                              int64_t column, int64_t index) {
    __m256 value = _mm256_mul_ps(_mm256_cvtepi32_ps(sums), _mm256_loadu_ps(m->weight_scales + column));
    value = _mm256_mul_ps(value, row_scale);
    if (m->bias != NULL) {
        value = _mm256_add_ps(value, _mm256_loadu_ps(m->bias + column));
    }
    if (m->dtype == DTYPE_BFLOAT16) {
        __m256i bits = _mm256_castps_si256(value);
        __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
        bits = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
        /* Packing works within 128-bit halves: the two halves' low quarters hold the eight. */
        __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(bits, bits), 0x08);
        _mm_storeu_si128((__m128i *)((uint16_t *)m->out + index), _mm256_castsi256_si128(packed));
    } else {
        _mm256_storeu_ps((float *)m->out + index, value);
    }
}

static inline __attribute__((always_inline)) void store_tile_row(const W8A8Matmul *m, __m256i sums[2], int64_t row,
                                                                 int64_t column, int64_t cols) {
    if (cols == PANEL_COLUMNS) {
        __m256 row_scale = _mm256_set1_ps(m->row_scales[row]);
        for (int v = 0; v < 2; v++) {
            store_eight(m, sums[v], row_scale, column + 8 * v, row * m->out_features + column + 8 * v);
        }
        return;
    }
    /* The last panel's outputs past out_features: element by element, in the same operations. */
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

#endif

#if defined(__AVX2__)
/* Rows [begin, end) by one panel in this ISA's tiles of TILE_ROWS rows. */
static void multiply_panel_rows(const W8A8Matmul *m, int64_t begin, int64_t end, int64_t panel) {
    for (int64_t row = begin; row < end; row += TILE_ROWS) {
        multiply_rows(end - row < TILE_ROWS ? (int)(end - row) : TILE_ROWS, m, row, panel);
    }
}

/* Rows [row_begin, row_end) by panels [panel_begin, panel_end): blocks of `row_block` rows, each
 * meeting every panel. */
static void multiply_block(const W8A8Matmul *m, int64_t row_begin, int64_t row_end, int64_t panel_begin,
                           int64_t panel_end, int64_t row_block) {
    for (int64_t block = row_begin; block < row_end; block += row_block) {
        int64_t block_end = block + row_block < row_end ? block + row_block : row_end;
        for (int64_t panel = panel_begin; panel < panel_end; panel++) {
            multiply_panel_rows(m, block, block_end, panel);
        }
    }
}

/* This thread's share of the product, inside the parallel region. On AMX: full tiles (the rows
 * past the last whole 32 from their padded copy), or for a call of fewer than 32 rows tiles
 * configured to that many; up to PANEL_FIRST_SHARE_ROWS rows panel by panel, more in blocks of 32
 * rows. */
static void multiply_share(const W8A8Matmul *m, int64_t panels) {
#if W8A8_AMX
    ProductShare share = thread_product_share(m->rows, panels, m->use_amx ? AMX_TILE_ROWS : TILE_ROWS);
    if (m->use_amx) {
        int64_t share_rows = share.row_end - share.row_begin;
        if (share_rows == 0 || share.panel_end == share.panel_begin) {
            return;
        }
        if (m->rows < AMX_TILE_ROWS) {
            configure_row_tiles((int)m->rows);
        } else {
            configure_full_tiles();
        }
        int64_t row_block = share_rows <= PANEL_FIRST_SHARE_ROWS ? share_rows : AMX_ROW_BLOCK;
        int overlapped = m->rows >= AMX_TILE_ROWS && (m->silu_gated || m->in_quads >= OVERLAP_MIN_QUADS);
        amx_multiply_block(m, share.row_begin, share.row_end, share.panel_begin, share.panel_end, row_block,
                           overlapped);
        _tile_release();
        return;
    }
#else
    ProductShare share = thread_product_share(m->rows, panels, TILE_ROWS);
#endif
    multiply_block(m, share.row_begin, share.row_end, share.panel_begin, share.panel_end, ROW_BLOCK);
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
/* out [rows, out_features] in `dtype` = the W8A8 product of uint8 activation levels (level + 128)
 * [rows, in_features] with their row_scales [rows] and the packed int8 weights (ft_pack_w8a8_weight)
 * with their weight_scales [out_features], plus float32 bias [out_features] unless NULL; on AMX-INT8
 * tiles where use_amx asks (the caller holds the OS's permission for them) and the build has them.
 * Where silu_gated (weights packed so), out is [rows, out_features / 2]: SwiGLU's product of that
 * gate | up product, the bits ft_silu_and_mul makes of it. */
FtStatus ft_w8a8_matmul(const uint8_t *levels, const float *row_scales, const void *weight,
                        const float *weight_scales, const float *bias, void *out, int64_t rows, int64_t out_features,
                        int64_t in_features, int dtype, int num_threads, int use_amx, int silu_gated) {
    if (silu_gated && out_features % 2 != 0) {
        return FT_BAD_SHAPE;
    }
    int64_t in_quads = (in_features + 3) / 4, panels = vnni_panels(out_features);
    uint8_t *padded = NULL;
    if (in_features % 4 != 0) {
        padded = malloc((size_t)(rows * 4 * in_quads));
        if (padded == NULL) {
            return FT_OUT_OF_MEMORY;
        }
    }
    uint8_t *tail_levels = NULL;
    int64_t tail_row = rows;
#if W8A8_AMX
    use_amx = use_amx && in_quads % AMX_STEP_QUADS == 0;
    tail_row = rows / AMX_TILE_ROWS * AMX_TILE_ROWS;
    if (use_amx && rows > AMX_TILE_ROWS && tail_row < rows) {
        tail_levels = calloc(AMX_TILE_ROWS, (size_t)(4 * in_quads));
        if (tail_levels == NULL) {
            free(padded);
            return FT_OUT_OF_MEMORY;
        }
        pad_levels(levels + tail_row * in_features, 0, rows - tail_row, in_features, in_quads, tail_levels);
    }
#else
    use_amx = 0;
#endif
    const int8_t *packed = weight;
    W8A8Matmul m = {padded != NULL ? padded : levels, row_scales, packed,
                    (const int32_t *)(packed + panels * PANEL_COLUMNS * in_quads * 4), weight_scales, bias, rows,
                    out_features, in_quads, out, dtype, use_amx, tail_levels, tail_row, silu_gated};
    int parallel = worth_threads(rows, out_features, in_features) && num_threads > 1;
#pragma omp parallel num_threads(num_threads) if (parallel)
    {
        if (padded != NULL) {
            int64_t begin, end;
            thread_rows(rows, &begin, &end);
            pad_levels(levels, begin, end, in_features, in_quads, padded);
#pragma omp barrier
        }
        multiply_share(&m, panels);
    }
    free(padded);
    free(tail_levels);
    return FT_OK;
}

#elif defined(__AVX2__)
/* out [rows, out_features] in `dtype` = the W8A8 product of uint8 activation levels (level + 128)
 * [rows, in_features] with their row_scales [rows] and the packed int8 weights (ft_pack_w8a8_weight)
 * with their weight_scales [out_features], plus float32 bias [out_features] unless NULL (use_amx:
 * no tiles in this build). */
FtStatus ft_w8a8_matmul(const uint8_t *levels, const float *row_scales, const void *weight,
                        const float *weight_scales, const float *bias, void *out, int64_t rows, int64_t out_features,
                        int64_t in_features, int dtype, int num_threads, int use_amx, int silu_gated) {
    if (silu_gated) {
        return FT_BAD_SHAPE;
    }
    int64_t in_pairs = (in_features + 1) / 2;
    int16_t *activations = malloc((size_t)(rows * 2 * in_pairs) * sizeof(int16_t));
    if (activations == NULL) {
        return FT_OUT_OF_MEMORY;
    }
    W8A8Matmul m = {activations, row_scales, weight, weight_scales, bias, rows, out_features, in_pairs, out, dtype};
    (void)use_amx;
    int64_t panels = (out_features + PANEL_COLUMNS - 1) / PANEL_COLUMNS;
    int parallel = worth_threads(rows, out_features, in_features) && num_threads > 1;
#pragma omp parallel num_threads(num_threads) if (parallel)
    {
        int64_t begin, end;
        thread_rows(rows, &begin, &end);
        widen_levels(levels, begin, end, in_features, in_pairs, activations);
#pragma omp barrier
        multiply_share(&m, panels);
    }
    free(activations);
    return FT_OK;
}
#endif
