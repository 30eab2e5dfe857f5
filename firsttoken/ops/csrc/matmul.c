/* A row-invariant float32 matmul: y = x W^T (+ bias), for every CPU class through isa.h.
 *
 * Every output element is ONE chain of fused multiply-adds over k = 0 .. K-1 in order,
 * started from zero, with the bias added last. Vectors run across output columns, never
 * across K; there is no split-K; blocking along K stores and reloads a float32 partial,
 * which is exact. So a row's bits never depend on how many rows the call has, where the
 * row falls in a tile, or how many threads share the work: what batch invariance needs.
 *
 * W is packed once at load into panels of PANEL_WIDTH output columns, [panels][K][PANEL_WIDTH]
 * (the last panel zero-padded), in float32 or bf16 (widened in registers: exact). A tile of
 * TILE_ROWS rows by one panel keeps its sums in registers: on AVX2 6 x 16 = 12 ymm sums, one
 * broadcast of x and two loads of W per k. Threads split the panels (and the rows where
 * panels are few); every element's arithmetic is the same whichever thread runs it.
 *
 * Decode-sized steps are bound by reading W. Where W is the dequantization of a GGUF-style
 * block format (per LEVELS_GROUP inputs of an output: w = level * scale (+ offset), levels of
 * 4 or 8 bits, scale and offset fp16 values), `ft_row_invariant_levels_matmul` reads the levels
 * and rebuilds each w in registers with one FMA: level * scale has at most 11 + 8 bits, so it
 * is exact and the FMA rounds once, as the dequantization's multiply-then-add does. Every w is
 * the same float, in the same FMA chain: the same bits as the float32 form, at a fifth of
 * its bytes (4-bit levels).
 */
/* Before the includes (see isa.h). No reassociation: GCC may unroll a fixed-length loop over k
 * into one block and regroup its chain of adds, and the two weight forms below must give the
 * same bits. */
#pragma GCC optimize("no-associative-math", "fp-contract=fast")
#include "common.h"
#include "isa.h"

/* A panel is two vectors wide; the tile's rows fill the registers left over (16 on AVX2 and
 * SSE/NEON, 32 on AVX-512): sums, the two W vectors and the broadcast x. */
#define PANEL_VECTORS 2
#define PANEL_WIDTH (PANEL_VECTORS * VEC_WIDTH)
#if VEC_WIDTH >= 16
#define TILE_ROWS 12
#else
#define TILE_ROWS 6
#endif
/* A panel's K_BLOCK x PANEL_WIDTH slice of W (16 KiB in float32 on AVX2) stays in L1 while
 * ROW_BLOCK rows of x (their K_BLOCK columns: 96 KiB) stay in L2. */
#define K_BLOCK 256
#define ROW_BLOCK (16 * TILE_ROWS)

/* What one call multiplies. */
typedef struct {
    const float *x;
    int64_t x_stride;
    int64_t rows;
    const void *weight; /* packed: [panels][in_features][PANEL_WIDTH] */
    int weight_is_bf16;
    const float *bias; /* [out_features] or NULL */
    int64_t out_features;
    int64_t in_features;
    float *out; /* [rows][out_features] */
} Matmul;

int ft_matmul_panel_width(void) {
    return PANEL_WIDTH;
}

#define ALWAYS_INLINE static inline __attribute__((always_inline))

ALWAYS_INLINE vfloat load_weight(const void *panel, int64_t index, const int is_bf16) {
    return is_bf16 ? vf_load_bf16((const uint16_t *)panel + index) : vf_load((const float *)panel + index);
}

/* Loads `rows` x PANEL_WIDTH partial sums from out (its first `cols` columns valid). */
ALWAYS_INLINE void load_sums(
    const int rows, vfloat sums[TILE_ROWS][PANEL_VECTORS], const float *out, int64_t out_stride,
    int64_t cols) {
    for (int r = 0; r < rows; r++) {
        float row[PANEL_WIDTH] = {0};
        const float *source = out + r * out_stride;
        if (cols < PANEL_WIDTH) {
            memcpy(row, source, (size_t)cols * sizeof(float));
            source = row;
        }
        for (int v = 0; v < PANEL_VECTORS; v++) {
            sums[r][v] = vf_load(source + v * VEC_WIDTH);
        }
    }
}

ALWAYS_INLINE void store_sums(
    const int rows, vfloat sums[TILE_ROWS][PANEL_VECTORS], float *out, int64_t out_stride, int64_t cols) {
    for (int r = 0; r < rows; r++) {
        float row[PANEL_WIDTH];
        float *destination = cols < PANEL_WIDTH ? row : out + r * out_stride;
        for (int v = 0; v < PANEL_VECTORS; v++) {
            vf_store(destination + v * VEC_WIDTH, sums[r][v]);
        }
        if (cols < PANEL_WIDTH) {
            memcpy(out + r * out_stride, row, (size_t)cols * sizeof(float));
        }
    }
}

/* out[r][c] (+)= sum over k in [k_begin, k_end) of x[r][k] * W[c][k], one FMA at a time in k's
 * order, for `rows` rows and one panel's `cols` columns; the first block starts from zero and
 * the last adds the bias. */
ALWAYS_INLINE void multiply_tile(
    const int rows, const int is_bf16, const Matmul *m, int64_t row, int64_t panel, int64_t k_begin,
    int64_t k_end) {
    int64_t column = panel * PANEL_WIDTH;
    int64_t cols = m->out_features - column < PANEL_WIDTH ? m->out_features - column : PANEL_WIDTH;
    float *out = m->out + row * m->out_features + column;
    const float *x = m->x + row * m->x_stride;
    int64_t panel_start = panel * m->in_features * PANEL_WIDTH;
    const void *weights = is_bf16 ? (const void *)((const uint16_t *)m->weight + panel_start)
                                  : (const void *)((const float *)m->weight + panel_start);
    vfloat sums[TILE_ROWS][PANEL_VECTORS];
    if (k_begin == 0) {
#pragma GCC unroll 16
        for (int r = 0; r < rows; r++) {
            for (int v = 0; v < PANEL_VECTORS; v++) {
                sums[r][v] = vf_splat(0.0f);
            }
        }
    } else {
        load_sums(rows, sums, out, m->out_features, cols);
    }
    for (int64_t k = k_begin; k < k_end; k++) {
        vfloat w[PANEL_VECTORS];
        for (int v = 0; v < PANEL_VECTORS; v++) {
            w[v] = load_weight(weights, k * PANEL_WIDTH + v * VEC_WIDTH, is_bf16);
        }
#pragma GCC unroll 16
        for (int r = 0; r < rows; r++) {
            vfloat xr = vf_splat(x[r * m->x_stride + k]);
            for (int v = 0; v < PANEL_VECTORS; v++) {
                sums[r][v] += xr * w[v];
            }
        }
    }
    if (k_end == m->in_features && m->bias != NULL) {
        float bias[PANEL_WIDTH] = {0};
        memcpy(bias, m->bias + column, (size_t)cols * sizeof(float));
        for (int r = 0; r < rows; r++) {
            for (int v = 0; v < PANEL_VECTORS; v++) {
                sums[r][v] += vf_load(bias + v * VEC_WIDTH);
            }
        }
    }
    store_sums(rows, sums, out, m->out_features, cols);
}

#define TILE_CASE(count)                                                            \
    case count:                                                                     \
        if (m->weight_is_bf16) {                                                    \
            multiply_tile(count, 1, m, row, panel, k_begin, k_end);                 \
        } else {                                                                    \
            multiply_tile(count, 0, m, row, panel, k_begin, k_end);                 \
        }                                                                           \
        break;

/* One tile of 1 to TILE_ROWS rows, each row count its own unrolled code. */
static void multiply_rows(int rows, const Matmul *m, int64_t row, int64_t panel, int64_t k_begin,
                          int64_t k_end) {
    switch (rows) {
        TILE_CASES_1_TO_6(TILE_CASE)
#if TILE_ROWS > 6
        TILE_CASES_7_TO_12(TILE_CASE)
#endif
    }
}

/* Rows [row_begin, row_end) by panels [panel_begin, panel_end). */
static void multiply_block(const Matmul *m, int64_t row_begin, int64_t row_end, int64_t panel_begin,
                           int64_t panel_end) {
    for (int64_t block = row_begin; block < row_end; block += ROW_BLOCK) {
        int64_t block_end = block + ROW_BLOCK < row_end ? block + ROW_BLOCK : row_end;
        for (int64_t k = 0; k < m->in_features; k += K_BLOCK) {
            int64_t k_end = k + K_BLOCK < m->in_features ? k + K_BLOCK : m->in_features;
            for (int64_t panel = panel_begin; panel < panel_end; panel++) {
                for (int64_t row = block; row < block_end; row += TILE_ROWS) {
                    int rows = block_end - row < TILE_ROWS ? (int)(block_end - row) : TILE_ROWS;
                    multiply_rows(rows, m, row, panel, k, k_end);
                }
            }
        }
    }
}

/* out [rows, out_features] = x [rows, in_features] (rows `x_stride` floats apart) times the
 * packed W^T (float32, or bf16 when weight_dtype is DTYPE_BFLOAT16), plus bias if not NULL.
 * Returns FT_OK. */
FtStatus ft_row_invariant_matmul(const float *x, int64_t x_stride, int64_t rows, const void *weight,
                                 int weight_dtype, const float *bias, int64_t out_features, int64_t in_features,
                                 float *out, int num_threads) {
    int is_bf16 = weight_dtype == DTYPE_BFLOAT16;
    Matmul m = {x, x_stride, rows, weight, is_bf16, bias, out_features, in_features, out};
    int64_t panels = (out_features + PANEL_WIDTH - 1) / PANEL_WIDTH;
    int parallel = rows * out_features * in_features >= PARALLEL_MIN_ELEMENTS * 16 && num_threads > 1;
#pragma omp parallel num_threads(num_threads) if (parallel)
    {
        ProductShare share = thread_product_share(rows, panels, TILE_ROWS);
        multiply_block(&m, share.row_begin, share.row_end, share.panel_begin, share.panel_end);
    }
    return FT_OK;
}

/* ---- Weights as levels: what one call multiplies ---- */
typedef struct {
    const float *x;
    int64_t x_stride;
    const uint8_t *levels;  /* [panels][in_features][PANEL_WIDTH * level_bits / 8] */
    const float *scales;    /* [panels][in_features / LEVELS_GROUP][PANEL_WIDTH] */
    const float *offsets;   /* same layout, or NULL: no offset (8-bit levels) */
    const float *bias;      /* [out_features] or NULL */
    int64_t out_features;
    int64_t in_features;
    float *out;
} LevelsMatmul;

/* The PANEL_WIDTH weights of input k: 4-bit levels hold column c in the low nibble of byte c
 * and column VEC_WIDTH + c in its high one; 8-bit levels are signed, a byte per column. */
ALWAYS_INLINE void level_weights(const int level_bits, const uint8_t *levels, int64_t k, const vfloat scale[2],
                                 const vfloat offset[2], vfloat w[2]) {
    if (level_bits == 4) {
        vint packed = vi_load_u8(levels + k * VEC_WIDTH);
        w[0] = __builtin_convertvector(packed & 15, vfloat) * scale[0] + offset[0];
        w[1] = __builtin_convertvector(packed >> 4, vfloat) * scale[1] + offset[1];
    } else {
        for (int v = 0; v < PANEL_VECTORS; v++) {
            vint level = vi_load_i8((const int8_t *)levels + k * PANEL_WIDTH + v * VEC_WIDTH);
            w[v] = __builtin_convertvector(level, vfloat) * scale[v];
        }
    }
}

/* out[row .. row + rows) of one panel, over all of K in one pass: each sum one FMA chain from
 * zero in k's order, the bias added last, as multiply_tile computes it. */
ALWAYS_INLINE void levels_tile(const int rows, const int level_bits, const LevelsMatmul *m, int64_t row,
                               int64_t panel) {
    _Static_assert(PANEL_VECTORS == 2, "4-bit levels pack a panel's two vectors in one byte");
    int64_t column = panel * PANEL_WIDTH;
    int64_t cols = m->out_features - column < PANEL_WIDTH ? m->out_features - column : PANEL_WIDTH;
    int64_t groups = m->in_features / LEVELS_GROUP;
    const uint8_t *levels = m->levels + panel * m->in_features * (PANEL_WIDTH * level_bits / 8);
    const float *scales = m->scales + panel * groups * PANEL_WIDTH;
    const float *offsets = m->offsets != NULL ? m->offsets + panel * groups * PANEL_WIDTH : NULL;
    const float *x = m->x + row * m->x_stride;
    vfloat sums[TILE_ROWS][PANEL_VECTORS];
#pragma GCC unroll 16
    for (int r = 0; r < rows; r++) {
        for (int v = 0; v < PANEL_VECTORS; v++) {
            sums[r][v] = vf_splat(0.0f);
        }
    }
    for (int64_t group = 0; group < groups; group++) {
        vfloat scale[PANEL_VECTORS], offset[PANEL_VECTORS];
        for (int v = 0; v < PANEL_VECTORS; v++) {
            scale[v] = vf_load(scales + group * PANEL_WIDTH + v * VEC_WIDTH);
            offset[v] = offsets != NULL ? vf_load(offsets + group * PANEL_WIDTH + v * VEC_WIDTH) : vf_splat(0.0f);
        }
        for (int64_t k = group * LEVELS_GROUP; k < (group + 1) * LEVELS_GROUP; k++) {
            vfloat w[PANEL_VECTORS];
            level_weights(level_bits, levels, k, scale, offset, w);
#pragma GCC unroll 16
            for (int r = 0; r < rows; r++) {
                vfloat xr = vf_splat(x[r * m->x_stride + k]);
                for (int v = 0; v < PANEL_VECTORS; v++) {
                    sums[r][v] += xr * w[v];
                }
            }
        }
    }
    if (m->bias != NULL) {
        float bias[PANEL_WIDTH] = {0};
        memcpy(bias, m->bias + column, (size_t)cols * sizeof(float));
        for (int r = 0; r < rows; r++) {
            for (int v = 0; v < PANEL_VECTORS; v++) {
                sums[r][v] += vf_load(bias + v * VEC_WIDTH);
            }
        }
    }
    store_sums(rows, sums, m->out + row * m->out_features + column, m->out_features, cols);
}

#define LEVELS_CASE(count)                                \
    case count:                                           \
        if (level_bits == 4) {                            \
            levels_tile(count, 4, m, row, panel);         \
        } else {                                          \
            levels_tile(count, 8, m, row, panel);         \
        }                                                 \
        break;

static void levels_rows(int rows, int level_bits, const LevelsMatmul *m, int64_t row, int64_t panel) {
    switch (rows) {
        LEVELS_CASE(1)
        LEVELS_CASE(2)
        LEVELS_CASE(3)
        LEVELS_CASE(4)
    }
}

/* out [rows, out_features] = x [rows, in_features] (rows `x_stride` floats apart) times W^T
 * rebuilt from its levels (level_bits 4: with offsets; 8: without), plus bias if not NULL: the
 * bits of ft_row_invariant_matmul on the dequantized W. rows <= LEVELS_MAX_ROWS, in_features
 * a multiple of LEVELS_GROUP. Threads split the panels. */
FtStatus ft_row_invariant_levels_matmul(const float *x, int64_t x_stride, int64_t rows, const uint8_t *levels,
                                        int level_bits, const float *scales, const float *offsets,
                                        const float *bias, int64_t out_features, int64_t in_features, float *out,
                                        int num_threads) {
    if (rows > LEVELS_MAX_ROWS || in_features % LEVELS_GROUP != 0 || (level_bits != 4 && level_bits != 8)) {
        return FT_BAD_SHAPE;
    }
    LevelsMatmul m = {x, x_stride, levels, scales, offsets, bias, out_features, in_features, out};
    int64_t panels = (out_features + PANEL_WIDTH - 1) / PANEL_WIDTH;
    int parallel = out_features * in_features >= PARALLEL_MIN_ELEMENTS * 16 && num_threads > 1;
#pragma omp parallel num_threads(num_threads) if (parallel)
    {
        int64_t begin, end;
        thread_rows(panels, &begin, &end);
        for (int64_t panel = begin; panel < end; panel++) {
            for (int64_t row = 0; row < rows; row += 4) {
                levels_rows(rows - row < 4 ? (int)(rows - row) : 4, level_bits, &m, row, panel);
            }
        }
    }
    return FT_OK;
}
