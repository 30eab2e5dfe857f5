/* A bf16 engine's LM head with float32 logits: bf16 rows times bf16 weights, each logit summed and
 * kept in float32 (TDPBF16PS or VDPBF16PS). oneDNN's bf16 product rounds every logit to bf16, 8 bits of
 * mantissa: logits near 15 move in steps of 0.06, so two candidates that close tie or swap, and
 * a greedy token is decided by that rounding (on SmolLM2 about a third of the positions where
 * bf16 picks another token than float32).
 *
 * The weights are packed once as [panels of 16 outputs][input pairs][16 outputs x 2 inputs]:
 * one 64-byte vector per panel and input pair, which one broadcast of a row's two inputs meets.
 * Each logit's sum runs over the input pairs in one fixed order whatever the row count and
 * tiling, so a row's logits never depend on the other rows of the step. Threads split the panels; a panel
 * stays in L1 while every row meets it, so the weights are read once per call. On CPUs with AMX
 * the packed panels are B tiles as they lie (16 input pairs by 16 outputs) and TDPBF16PS sums 16
 * rows at a time (a tile's rows never mix; the last block padded with zero rows); else VDPBF16PS
 * broadcasts each row's input pair.
 * The two give a row different bits, each the same at any row count.
 *
 * Built at run time by firsttoken/ops/native_build.py with the machine's C compiler.
 */
#include "common.h"

#if VECTOR_BF16
#define LOGITS_PANEL 16
/* Rows whose sums one pass over a panel keeps in registers. */
#define LOGITS_TILE_ROWS 8

static int64_t logits_panels(int64_t vocab) {
    return (vocab + LOGITS_PANEL - 1) / LOGITS_PANEL;
}

/* Elements (bf16) of the packed weight of a [vocab, hidden] head; hidden a multiple of 4. */
int64_t ft_logits_packed_elements(int64_t vocab, int64_t hidden) {
    return logits_panels(vocab) * LOGITS_PANEL * hidden;
}

/* weight bf16 [vocab, hidden] (hidden a multiple of 4) into the panel layout above, outputs past
 * vocab zero. */
FtStatus ft_pack_logits_weight(const uint16_t *weight, int64_t vocab, int64_t hidden, uint16_t *packed) {
    if (hidden % 4 != 0) {
        return FT_BAD_SHAPE;
    }
    int64_t pairs = hidden / 2;
    for (int64_t panel = 0; panel < logits_panels(vocab); panel++) {
        for (int64_t pair = 0; pair < pairs; pair++) {
            uint16_t *destination = packed + ((panel * pairs + pair) * LOGITS_PANEL) * 2;
            for (int64_t lane = 0; lane < LOGITS_PANEL; lane++) {
                int64_t output = panel * LOGITS_PANEL + lane;
                for (int64_t half = 0; half < 2; half++) {
                    destination[lane * 2 + half] = output < vocab ? weight[output * hidden + 2 * pair + half] : 0;
                }
            }
        }
    }
    return FT_OK;
}

/* `rows` rows (a compile-time constant where inlined) from `first_row` by one panel: each row's
 * sum in two chains, the even input pairs' and the odd ones', added at the end (one chain would
 * wait on each VDPBF16PS's latency when few rows share the panel). */
static inline __attribute__((always_inline)) void logits_tile(const int rows, const uint16_t *x, int64_t first_row,
                                                              const uint16_t *panel_weights, int64_t pairs,
                                                              int64_t hidden, __mmask16 lanes, float *out,
                                                              int64_t vocab) {
    __m512 even[LOGITS_TILE_ROWS], odd[LOGITS_TILE_ROWS];
    for (int r = 0; r < rows; r++) {
        even[r] = odd[r] = _mm512_setzero_ps();
    }
    const uint16_t *row_inputs = x + first_row * hidden;
    for (int64_t pair = 0; pair < pairs; pair += 2) {
        __m512bh even_weights = (__m512bh)_mm512_loadu_si512(panel_weights + pair * LOGITS_PANEL * 2);
        __m512bh odd_weights = (__m512bh)_mm512_loadu_si512(panel_weights + (pair + 1) * LOGITS_PANEL * 2);
        for (int r = 0; r < rows; r++) {
            /* broadcast from memory: a load, where a register's would take the shuffle port */
            const uint16_t *inputs = row_inputs + r * hidden + 2 * pair;
            __m512bh even_inputs = (__m512bh)_mm512_broadcastd_epi32(_mm_loadu_si32(inputs));
            __m512bh odd_inputs = (__m512bh)_mm512_broadcastd_epi32(_mm_loadu_si32(inputs + 2));
            even[r] = _mm512_dpbf16_ps(even[r], even_inputs, even_weights);
            odd[r] = _mm512_dpbf16_ps(odd[r], odd_inputs, odd_weights);
        }
    }
    for (int r = 0; r < rows; r++) {
        _mm512_mask_storeu_ps(out + (first_row + r) * vocab, lanes, _mm512_add_ps(even[r], odd[r]));
    }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
/* Rows [row, row + 16) of `x` (whole blocks: the call's rows padded with zero rows) by panel
 * `panel`, hidden a multiple of 32, on C tile 0, A tile 4 (the rows' inputs) and B tile 6; the
 * rows below `rows` and outputs below vocab are stored, straight from the tile where both are
 * whole. */
static void logits_tile_block(const uint16_t *x, int64_t row, int64_t rows, const uint16_t *packed, int64_t panel,
                              int64_t vocab, int64_t hidden, float *out) {
    const uint16_t *weights = packed + panel * hidden * LOGITS_PANEL;
    _tile_zero(0);
    for (int64_t input = 0; input < hidden; input += 32) {
        _tile_loadd(4, x + row * hidden + input, hidden * 2);
        _tile_loadd(6, weights + input * LOGITS_PANEL, 64);
        _tile_dpbf16ps(0, 4, 6);
    }
    int64_t first_output = panel * LOGITS_PANEL;
    if (row + 16 <= rows && first_output + LOGITS_PANEL <= vocab) {
        _tile_stored(0, out + row * vocab + first_output, vocab * 4);
        return;
    }
    float sums[16][LOGITS_PANEL] __attribute__((aligned(64)));
    _tile_stored(0, sums, 64);
    for (int64_t r = 0; r < 16 && row + r < rows; r++) {
        _mm512_mask_storeu_ps(out + (row + r) * vocab + first_output, tail_mask(vocab - first_output),
                              _mm512_load_ps(sums[r]));
    }
}

/* This thread's panels [begin, end), each meeting every block of 16 of the padded rows while it is
 * in this core's cache: the weights are read once per call. */
static void amx_logits_share(const uint16_t *padded_x, int64_t rows, const uint16_t *packed, int64_t begin,
                             int64_t end, int64_t vocab, int64_t hidden, float *out) {
    configure_full_tiles();
    for (int64_t panel = begin; panel < end; panel++) {
        for (int64_t row = 0; row < rows; row += 16) {
            logits_tile_block(padded_x, row, rows, packed, panel, vocab, hidden, out);
        }
    }
    _tile_release();
}
#endif

#define LOGITS_TILE_CASE(count)                                                                                  \
    case count: logits_tile(count, x, row, panel_weights, pairs, hidden, lanes, panel_out, vocab); break;

/* out float32 [rows, vocab] = x bf16 [rows, hidden] . weight^T, from ft_pack_logits_weight's
 * `packed`; hidden a multiple of 4 (of 32 on tiles: use_amx, only where ft_amx_available said 1
 * and the build has AMX). */
FtStatus ft_bf16_logits(const uint16_t *x, const uint16_t *packed, int64_t rows, int64_t vocab, int64_t hidden,
                        float *out, int num_threads, int use_amx) {
    if (hidden % 4 != 0 || (use_amx && hidden % 32 != 0)) {
        return FT_BAD_SHAPE;
    }
    int64_t pairs = hidden / 2, panels = logits_panels(vocab);
    /* Tiles read whole blocks of 16 rows: the rows past the last whole block padded with zeros. */
    uint16_t *padded_x = NULL;
    if (use_amx && rows % 16 != 0) {
        int64_t padded_rows = (rows + 15) / 16 * 16;
        padded_x = calloc((size_t)(padded_rows * hidden), sizeof(uint16_t));
        if (padded_x == NULL) {
            return FT_OUT_OF_MEMORY;
        }
        memcpy(padded_x, x, (size_t)(rows * hidden) * sizeof(uint16_t));
    }
#pragma omp parallel num_threads(num_threads) if (vocab * hidden >= 4 * PARALLEL_MIN_ELEMENTS)
    {
        int64_t begin, end;
        thread_rows(panels, &begin, &end);
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
        if (use_amx) {
            amx_logits_share(padded_x != NULL ? padded_x : x, rows, packed, begin, end, vocab, hidden, out);
            begin = end;
        }
#endif
        for (int64_t panel = begin; panel < end; panel++) {
            const uint16_t *panel_weights = packed + panel * pairs * LOGITS_PANEL * 2;
            __mmask16 lanes = tail_mask(vocab - panel * LOGITS_PANEL);
            float *panel_out = out + panel * LOGITS_PANEL;
            for (int64_t row = 0; row < rows; row += LOGITS_TILE_ROWS) {
                switch (rows - row < LOGITS_TILE_ROWS ? rows - row : LOGITS_TILE_ROWS) {
                    LOGITS_TILE_CASE(1)
                    LOGITS_TILE_CASE(2)
                    LOGITS_TILE_CASE(3)
                    LOGITS_TILE_CASE(4)
                    LOGITS_TILE_CASE(5)
                    LOGITS_TILE_CASE(6)
                    LOGITS_TILE_CASE(7)
                    LOGITS_TILE_CASE(8)
                }
            }
        }
    }
    free(padded_x);
    return FT_OK;
}
#endif
