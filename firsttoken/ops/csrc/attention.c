/* Causal attention, flash-style, in float32 arithmetic over float32 or bf16 tensors, written
 * once over isa.h so it builds for every CPU class (AVX2+FMA, AVX-512F, SSE2/NEON).
 *
 * Queries i attend keys j <= i + (num_keys - num_queries), and with a sliding window of W keys
 * only the last W of those (j > i + (num_keys - num_queries) - W); with a soft-cap C, each
 * scaled score s becomes C tanh(s / C) (Gemma 2). With S attention sinks beside a window
 * (StreamingLLM), a query also sees keys 0..S-1 once its window has left them, scored with its
 * own sink query (the query rotated at its position in the sinks-plus-window cache), in one
 * pass before the window's tiles. Keys stream through in tiles of
 * KEY_TILE at fixed positions from key 0, each with an online softmax (running max and sum per
 * query row, no score matrix): each key's score a chain of FMAs along the head dims in order,
 * VEC_WIDTH keys at a time from the tile's keys transposed once (one lane per key: no
 * horizontal sums), then output += P V. Rows that share a tile are computed a few at a time,
 * each load of a key column or a value serving them all, as a GEMM's micro-kernel does.
 *
 * A query row's bits depend on its own query, its keys and its position only: every row runs
 * the same chains of explicit FMAs (vf_fma) in the compiled bodies of score_rows,
 * update_softmax and weigh_values (noinline) over the same tiles, whether a prefill of many
 * rows, a chunk on cached context or a lone decode row computes it, whichever rows share its
 * group and however the work is split over threads. So a decode row gets exactly the bits a
 * prefill of the same tokens gives its position.
 *
 * Each K/V tile serves a block of rows (QUERY_BLOCK positions x the query heads of its KV
 * head) while it sits in the core's L1 cache. K/V are read in place: consecutive rows, or a
 * sequence's slots in the paged cache through its block ids (no gather copy); bf16 tiles are
 * widened to float32, and keys transposed, once per block of rows.
 *
 * Built at run time by firsttoken/ops/native_build.py with the machine's C compiler.
 */
#pragma GCC optimize("no-associative-math", "fp-contract=fast") /* before the includes: see isa.h */
#include "decode_kernels.h"
#include "isa.h"

#define KEY_TILE 64
#define QUERY_BLOCK 16
/* Rows that share one pass over a tile's values, and the output vectors of each it keeps in
 * registers: ROW_GROUP x DIM_GROUP accumulators, with a value and a weight beside them, fit the
 * 32 vector registers of AVX-512 and the 16 of the other builds. */
#if VEC_WIDTH == 16
#define ROW_GROUP 4
#else
#define ROW_GROUP 3
#endif
#define DIM_GROUP 4
/* Rows scored together, and the vectors of keys of each (accumulators, likewise). */
#if VEC_WIDTH == 16
#define SCORE_ROWS 4
#else
#define SCORE_ROWS 3
#endif
#define SCORE_KEY_VECTORS 4

/* The K and V rows of one sequence at one KV head: consecutive rows, or slots of a paged cache. */
typedef struct {
    const void *keys, *values;       /* row (or slot) 0, at the KV head */
    int64_t key_stride, value_stride; /* elements from one row (slot) to the next */
    const int64_t *blocks;           /* NULL: consecutive rows; else the sequence's block ids */
    int64_t block_size;
    int64_t count; /* keys that exist */
} KeyValueRows;

/* One sequence's queries and where their outputs go. */
typedef struct {
    const void *query; /* query 0's row, head 0 */
    int64_t query_stride;
    void *out; /* query 0's row, head 0 */
    int64_t out_stride;
    int64_t first_position; /* query 0's position: it sees keys 0..first_position */
    int64_t num_queries;
    int64_t window; /* > 0: a query at position p sees keys p - window + 1 .. p only */
    /* > 0 (with a window): keys 0..sink_tokens-1 seen too, scored with sink_query's rows. */
    int64_t sink_tokens;
    const void *sink_query; /* as query, rows query_stride apart */
    KeyValueRows kv; /* at KV head 0 */
} Sequence;

typedef struct {
    int64_t num_heads, num_kv_heads, head_dim;
    float scale;
    int dtype;
    float softcap; /* > 0: scaled scores soft-capped */
} Shape;

/* Up to KEY_TILE keys from `first_key` as float32 rows: in place, or widened into a buffer. */
typedef struct {
    const float *keys[KEY_TILE];
    const float *values[KEY_TILE];
    /* The keys transposed: dim d of key k at key_columns[d * KEY_TILE + k] (keys past the
     * tile's, zeros), so a score vector is VEC_WIDTH keys' chains of FMAs, one per lane. */
    const float *key_columns;
    int64_t key_vectors; /* vectors of keys the tile holds */
} KeyTile;

/* A query row's running softmax and its unnormalized output. */
typedef struct {
    float max;                /* of the scaled scores so far */
    float sums[VEC_WIDTH];    /* of their exponentials, by lane */
    float *output;            /* head_dim floats */
} RowState;

static const float zero_row[ATTENTION_MAX_HEAD_DIM];

static inline int64_t row_slot(const KeyValueRows *rows, int64_t index) {
    if (rows->blocks == NULL) {
        return index;
    }
    return rows->blocks[index / rows->block_size] * rows->block_size + index % rows->block_size;
}

static void widen_row(const uint16_t *source, int64_t head_dim, float *destination) {
    for (int64_t d = 0; d < head_dim; d += VEC_WIDTH) {
        vf_store(destination + d, vf_load_bf16(source + d));
    }
}

/* dims [first_dim, first_dim + VEC_WIDTH) of VEC_WIDTH key rows, transposed: dim first_dim + i
 * of the keys to columns + i * KEY_TILE. A butterfly: each level swaps one bit of the row index
 * with the same bit of the lane index, by two-vector shuffles. */
static void transpose_block(const float *const *keys, int64_t first_dim, float *columns) {
    vfloat rows[VEC_WIDTH];
    for (int i = 0; i < VEC_WIDTH; i++) {
        rows[i] = vf_load(keys[i] + first_dim);
    }
    const vint lanes = vi_lane_indices();
    /* Unrolled whole: constant indices and masks keep the rows in registers. */
#pragma GCC unroll 4
    for (int bit = VEC_WIDTH / 2; bit >= 1; bit /= 2) {
        /* Rows i (bit clear) and i + bit, as a and b (b's lanes indexed from VEC_WIDTH): lane l
         * of the new row i is a[l] where l has the bit clear, else b[l - bit]; of the new row
         * i + bit, a[l + bit] where clear, else b[l]. */
        const vint has_bit = (lanes & bit) != 0;
        const vint low = (has_bit & (lanes - bit + VEC_WIDTH)) | (~has_bit & lanes);
        const vint high = (has_bit & (lanes + VEC_WIDTH)) | (~has_bit & (lanes + bit));
#pragma GCC unroll 16
        for (int i = 0; i < VEC_WIDTH; i++) {
            if ((i & bit) == 0) {
                vfloat a = rows[i], b = rows[i + bit];
                rows[i] = __builtin_shuffle(a, b, low);
                rows[i + bit] = __builtin_shuffle(a, b, high);
            }
        }
    }
    for (int i = 0; i < VEC_WIDTH; i++) {
        vf_store(columns + i * KEY_TILE, rows[i]);
    }
}

/* The tile's `count` rows from `first_key`, up to a whole vector of keys (keys past the last,
 * and keys before `first_seen` that no row of the block sees, read as zeros and are never
 * touched: their blocks may have left a sliding window's sequence), and its keys transposed
 * into `key_columns`. */
static void load_tile(const KeyValueRows *rows, int64_t first_key, int64_t count, int64_t first_seen,
                      const Shape *shape, float *key_buffer, float *value_buffer, float *key_columns,
                      KeyTile *tile) {
    int64_t head_dim = shape->head_dim;
    for (int64_t k = 0; k < (count + VEC_WIDTH - 1) / VEC_WIDTH * VEC_WIDTH; k++) {
        int64_t index = first_key + k;
        if (k >= count || index >= rows->count || index < first_seen) {
            tile->keys[k] = tile->values[k] = zero_row;
            continue;
        }
        int64_t slot = row_slot(rows, index);
        if (shape->dtype == DTYPE_BFLOAT16) {
            widen_row((const uint16_t *)rows->keys + slot * rows->key_stride, head_dim, key_buffer + k * head_dim);
            widen_row((const uint16_t *)rows->values + slot * rows->value_stride, head_dim,
                      value_buffer + k * head_dim);
            tile->keys[k] = key_buffer + k * head_dim;
        } else {
            /* Read in place by the transposition below; the values are read once per row. */
            tile->keys[k] = (const float *)rows->keys + slot * rows->key_stride;
            memcpy(value_buffer + k * head_dim, (const float *)rows->values + slot * rows->value_stride,
                   (size_t)head_dim * sizeof(float));
        }
        tile->values[k] = value_buffer + k * head_dim;
    }
    tile->key_vectors = (count + VEC_WIDTH - 1) / VEC_WIDTH;
    for (int64_t g = 0; g < tile->key_vectors; g++) {
        for (int64_t d = 0; d < head_dim; d += VEC_WIDTH) {
            transpose_block(tile->keys + g * VEC_WIDTH, d, key_columns + d * KEY_TILE + g * VEC_WIDTH);
        }
    }
    tile->key_columns = key_columns;
}

/* For each of `rows` rows (a constant at each call site): output[dims] = output * rescale + sum
 * over keys j < valid of p[j] * V[j], in key order, for `vectors` (a constant too) vectors of
 * dims from `first_dim`. Rows of one call share each V load (their keys are the same); a lane's
 * chain is the same whichever group its row and dims fall in. */
static inline __attribute__((always_inline)) void weigh_dims(const float *const *p, const float *const *values,
                                                             int64_t valid, int64_t first_dim, const vfloat *rescale,
                                                             float *const *output, const int rows, const int vectors) {
    vfloat sums[ROW_GROUP][DIM_GROUP];
    for (int r = 0; r < rows; r++) {
        for (int v = 0; v < vectors; v++) {
            sums[r][v] = vf_load(output[r] + first_dim + v * VEC_WIDTH) * rescale[r];
        }
    }
    for (int64_t j = 0; j < valid; j++) {
        const float *row = values[j] + first_dim;
        for (int v = 0; v < vectors; v++) {
            vfloat value = vf_load(row + v * VEC_WIDTH);
            for (int r = 0; r < rows; r++) {
                sums[r][v] = vf_fma(vf_splat(p[r][j]), value, sums[r][v]);
            }
        }
    }
    for (int r = 0; r < rows; r++) {
        for (int v = 0; v < vectors; v++) {
            vf_store(output[r] + first_dim + v * VEC_WIDTH, sums[r][v]);
        }
    }
}

/* weigh_dims over all head dims, for `rows` rows (a constant at each call site). */
static inline __attribute__((always_inline)) void weigh_row_group(const float *const *p, const float *const *values,
                                                                  int64_t valid, int64_t dim_vectors,
                                                                  const vfloat *rescale, float *const *output,
                                                                  const int rows) {
    int64_t v = 0;
    for (; v + DIM_GROUP <= dim_vectors; v += DIM_GROUP) {
        weigh_dims(p, values, valid, v * VEC_WIDTH, rescale, output, rows, DIM_GROUP);
    }
    if (v + 4 <= dim_vectors) {
        weigh_dims(p, values, valid, v * VEC_WIDTH, rescale, output, rows, 4);
        v += 4;
    }
    if (v + 2 <= dim_vectors) {
        weigh_dims(p, values, valid, v * VEC_WIDTH, rescale, output, rows, 2);
        v += 2;
    }
    if (v < dim_vectors) {
        weigh_dims(p, values, valid, v * VEC_WIDTH, rescale, output, rows, 1);
    }
}

/* output += P V for 1..ROW_GROUP rows that see the same keys of the tile (j < valid). Not
 * inlined, as score_tile: whichever call a row comes from, and however many rows share its
 * group, its outputs run this body's chains. */
__attribute__((noinline)) static void weigh_values(const float *const *p, const float *const *values, int64_t valid,
                                                   int64_t dim_vectors, const vfloat *rescale, float *const *output,
                                                   int64_t rows) {
    switch (rows) {
    case 4:
        weigh_row_group(p, values, valid, dim_vectors, rescale, output, 4);
        break;
    case 3:
        weigh_row_group(p, values, valid, dim_vectors, rescale, output, 3);
        break;
    case 2:
        weigh_row_group(p, values, valid, dim_vectors, rescale, output, 2);
        break;
    default:
        weigh_row_group(p, values, valid, dim_vectors, rescale, output, 1);
    }
}

/* For each of `rows` rows (a constant at each call site): the scaled scores of `vectors` (a
 * constant too) vectors of keys from `first_vector`, each key's a chain of FMAs along the head
 * dims in order, soft-capped where asked; keys outside [skip, valid) of the row -inf. Rows of
 * one call share each load of a key column. */
static inline __attribute__((always_inline)) void score_keys(const float *const *queries, const KeyTile *tile,
                                                             const int64_t *skip, const int64_t *valid,
                                                             int64_t first_vector, int64_t head_dim, float scale,
                                                             float softcap, float *const *scores, const int rows,
                                                             const int vectors) {
    vfloat sums[SCORE_ROWS][SCORE_KEY_VECTORS];
    const float *columns = tile->key_columns + first_vector * VEC_WIDTH;
    for (int v = 0; v < vectors; v++) {
        vfloat column = vf_load(columns + v * VEC_WIDTH);
        for (int r = 0; r < rows; r++) {
            sums[r][v] = vf_splat(queries[r][0]) * column;
        }
    }
    for (int64_t d = 1; d < head_dim; d++) {
        for (int v = 0; v < vectors; v++) {
            vfloat column = vf_load(columns + d * KEY_TILE + v * VEC_WIDTH);
            for (int r = 0; r < rows; r++) {
                sums[r][v] = vf_fma(vf_splat(queries[r][d]), column, sums[r][v]);
            }
        }
    }
    const vint lanes = vi_lane_indices();
    for (int r = 0; r < rows; r++) {
        for (int v = 0; v < vectors; v++) {
            vint key = lanes + (int32_t)((first_vector + v) * VEC_WIDTH);
            vint inside = (key < (int32_t)valid[r]) & (key >= (int32_t)skip[r]);
            vfloat score = sums[r][v] * scale;
            if (softcap > 0.0f) {
                score = vf_splat(softcap) * vf_tanh(score / vf_splat(softcap));
            }
            vf_store(scores[r] + (first_vector + v) * VEC_WIDTH, vf_select(inside, score, vf_splat(-INFINITY)));
        }
    }
}

/* score_keys over the tile's key vectors, for `rows` rows (a constant at each call site). */
static inline __attribute__((always_inline)) void score_row_group(const float *const *queries, const KeyTile *tile,
                                                                  const int64_t *skip, const int64_t *valid,
                                                                  int64_t head_dim, float scale, float softcap,
                                                                  float *const *scores, const int rows) {
    int64_t v = 0;
    for (; v + SCORE_KEY_VECTORS <= tile->key_vectors; v += SCORE_KEY_VECTORS) {
        score_keys(queries, tile, skip, valid, v, head_dim, scale, softcap, scores, rows, SCORE_KEY_VECTORS);
    }
    for (; v < tile->key_vectors; v++) {
        score_keys(queries, tile, skip, valid, v, head_dim, scale, softcap, scores, rows, 1);
    }
}

/* The scaled scores of 1..SCORE_ROWS query rows over the tile's keys: row r's over keys
 * [skip[r], valid[r]) (valid 1..KEY_TILE: up to its causal limit; skip: those before its
 * window), the rest -inf. Not inlined (nor update_softmax, nor weigh_values): every row, from
 * whichever call and in whichever group, runs the chains of this one compiled body, so its bits
 * never depend on the caller. A block's rows score first, then update: the tile's keys, then
 * its values, stay in L1 across the rows. */
__attribute__((noinline)) static void score_rows(const float *const *queries, const KeyTile *tile,
                                                 const int64_t *skip, const int64_t *valid, int64_t head_dim,
                                                 float scale, float softcap, float *const *scores, int64_t rows) {
    switch (rows) {
#if SCORE_ROWS >= 4
    case 4:
        score_row_group(queries, tile, skip, valid, head_dim, scale, softcap, scores, 4);
        break;
#endif
    case 3:
        score_row_group(queries, tile, skip, valid, head_dim, scale, softcap, scores, 3);
        break;
    case 2:
        score_row_group(queries, tile, skip, valid, head_dim, scale, softcap, scores, 2);
        break;
    default:
        score_row_group(queries, tile, skip, valid, head_dim, scale, softcap, scores, 1);
    }
}

/* The online softmax update of a row from its tile's scores (keys [skip, valid) seen): the
 * scores become the probabilities (the keys before skip weigh exactly 0), and the factor its
 * output is rescaled by before output += P V (weigh_values) is returned. */
__attribute__((noinline)) static vfloat update_softmax(float *tile_scores, int64_t skip, int64_t valid,
                                                       RowState *state) {
    int64_t key_vectors = (valid + VEC_WIDTH - 1) / VEC_WIDTH;
    const vint lanes = vi_lane_indices();
    vfloat scores[KEY_TILE / VEC_WIDTH];
    vfloat tile_max = vf_splat(-INFINITY);
    for (int64_t g = 0; g < key_vectors; g++) {
        scores[g] = vf_load(tile_scores + g * VEC_WIDTH);
        tile_max = vf_max(tile_max, scores[g]);
    }
    float new_max = vf_max_lane(tile_max);
    new_max = state->max > new_max ? state->max : new_max;
    /* e^(old - new): exactly 1 when the max stands, ~0 on the first tile (old = -inf). */
    vfloat rescale = vf_splat(vf_exp(vf_splat(state->max - new_max))[0]);
    vfloat sums = vf_load(state->sums) * rescale;
    for (int64_t g = 0; g < key_vectors; g++) {
        vint key = lanes + (int32_t)(g * VEC_WIDTH);
        vint inside = (key < (int32_t)valid) & (key >= (int32_t)skip);
        vfloat p = vf_select(inside, vf_exp(scores[g] - new_max), vf_splat(0.0f));
        sums = sums + p;
        vf_store(tile_scores + g * VEC_WIDTH, p);
    }
    vf_store(state->sums, sums);
    state->max = new_max;
    return rescale;
}

/* out = output / sum, stored in `dtype`. Not inlined, as score_rows. */
__attribute__((noinline)) static void finish_row(const RowState *state, int64_t head_dim, int dtype, void *out) {
    vfloat inverse = vf_splat(1.0f / vf_sum(vf_load(state->sums)));
    for (int64_t d = 0; d < head_dim; d += VEC_WIDTH) {
        vfloat value = vf_load(state->output + d) * inverse;
        if (dtype == DTYPE_BFLOAT16) {
            vf_store_bf16((uint16_t *)out + d, value);
        } else {
            vf_store((float *)out + d, value);
        }
    }
}

/* What one thread works in: a block of rows' queries and states, and a widened tile. */
typedef struct {
    float *queries; /* max_rows * head_dim (bf16 queries, widened) */
    float *sink_queries; /* max_rows * head_dim (bf16 sink queries, widened) */
    float *outputs; /* max_rows * head_dim */
    float *scores;  /* max_rows * KEY_TILE: each row's scores of the tile at hand */
    RowState *states;
    const float **query_rows; /* max_rows: each row's float32 query */
    const float **sink_query_rows; /* max_rows: each row's float32 sink query */
    float *key_buffer, *value_buffer, *key_columns; /* KEY_TILE * head_dim each */
} Scratch;

static void free_scratch(Scratch *scratch) {
    free(scratch->queries);
    free(scratch->states);
    free(scratch->query_rows);
    free(scratch->sink_query_rows);
}

static int allocate_scratch(Scratch *scratch, int64_t max_rows, int64_t head_dim) {
    size_t floats = (size_t)((3 * max_rows + 3 * KEY_TILE) * head_dim + max_rows * KEY_TILE);
    scratch->queries = aligned_alloc(64, (floats * sizeof(float) + 63) / 64 * 64);
    scratch->states = malloc((size_t)max_rows * sizeof(RowState));
    scratch->query_rows = malloc((size_t)max_rows * sizeof(const float *));
    scratch->sink_query_rows = malloc((size_t)max_rows * sizeof(const float *));
    if (scratch->queries == NULL || scratch->states == NULL || scratch->query_rows == NULL
        || scratch->sink_query_rows == NULL) {
        free_scratch(scratch);
        return 0;
    }
    scratch->sink_queries = scratch->queries + max_rows * head_dim;
    scratch->outputs = scratch->sink_queries + max_rows * head_dim;
    scratch->key_buffer = scratch->outputs + max_rows * head_dim;
    scratch->value_buffer = scratch->key_buffer + KEY_TILE * head_dim;
    scratch->key_columns = scratch->value_buffer + KEY_TILE * head_dim;
    scratch->scores = scratch->key_columns + KEY_TILE * head_dim;
    return 1;
}

/* Keys of the tile from `first_key` that a query at `position` sees (>= 1 for the rows that
 * reach the tile). */
static inline int64_t tile_valid(int64_t position, int64_t first_key, int64_t num_keys) {
    int64_t limit = position < num_keys - 1 ? position : num_keys - 1;
    return limit - first_key + 1 < KEY_TILE ? limit - first_key + 1 : KEY_TILE;
}

/* The first key a query at `position` sees in the tiles: 0, or the start of its window (0 while
 * the window still reaches the sinks: all keys up to the query, then). */
static inline int64_t window_start(int64_t position, int64_t window, int64_t sink_tokens) {
    int64_t start = window > 0 && position - window + 1 > 0 ? position - window + 1 : 0;
    return start <= sink_tokens ? 0 : start;
}

/* Whether a query at `position` takes the sink pass: its window has left some sink. */
static inline int takes_sinks(int64_t position, int64_t window, int64_t sink_tokens) {
    return sink_tokens > 0 && window_start(position, window, sink_tokens) > 0;
}

/* Keys of the tile from `first_key` before the window of a query at `position`. */
static inline int64_t tile_skip(int64_t position, int64_t first_key, int64_t window, int64_t sink_tokens) {
    int64_t start = window_start(position, window, sink_tokens);
    return start > first_key ? start - first_key : 0;
}

/* Widens (bf16) or points at a query row of `base`, rows `stride` elements apart. */
static const float *query_row(const void *base, int64_t stride, int64_t position, int64_t head, const Shape *shape,
                              float *buffer) {
    int64_t head_dim = shape->head_dim;
    const char *row = (const char *)base + (position * stride + head * head_dim) * element_size(shape->dtype);
    if (shape->dtype == DTYPE_BFLOAT16) {
        widen_row((const uint16_t *)row, head_dim, buffer);
        return buffer;
    }
    return (const float *)row;
}

/* The scores of rows [first_row, rows) over a tile from `first_key`, in groups of up to
 * SCORE_ROWS rows that see some key of it (each row's own keys unmasked). */
static void score_tile_rows(Scratch *scratch, const KeyTile *tile, int64_t first_row, int64_t rows, int64_t heads,
                            int64_t first_position, int64_t first_key, int64_t num_keys, int64_t window,
                            int64_t sinks, const Shape *shape) {
    const float *queries[SCORE_ROWS];
    float *scores[SCORE_ROWS];
    int64_t skips[SCORE_ROWS], valids[SCORE_ROWS], group_rows = 0;
    for (int64_t r = first_row; r < rows; r++) {
        int64_t position = first_position + r / heads, valid = tile_valid(position, first_key, num_keys);
        int64_t skip = tile_skip(position, first_key, window, sinks);
        if (skip >= valid) {
            continue;
        }
        queries[group_rows] = scratch->query_rows[r];
        scores[group_rows] = scratch->scores + r * KEY_TILE;
        skips[group_rows] = skip;
        valids[group_rows] = valid;
        if (++group_rows == SCORE_ROWS) {
            score_rows(queries, tile, skips, valids, shape->head_dim, shape->scale, shape->softcap, scores, group_rows);
            group_rows = 0;
        }
    }
    if (group_rows > 0) {
        score_rows(queries, tile, skips, valids, shape->head_dim, shape->scale, shape->softcap, scores, group_rows);
    }
}

/* The softmax update and output += P V of rows [first_row, rows) over a tile from `first_key`:
 * runs of up to ROW_GROUP rows that see the same keys of it (a position's heads; every row,
 * below the causal diagonal and without a window) share each load of a value. */
static void update_rows(Scratch *scratch, const KeyTile *tile, int64_t first_row, int64_t rows, int64_t heads,
                        int64_t first_position, int64_t first_key, int64_t num_keys, int64_t window, int64_t sinks,
                        int64_t head_dim) {
    const float *probabilities[ROW_GROUP];
    float *outputs[ROW_GROUP];
    vfloat rescales[ROW_GROUP];
    int64_t group_rows = 0, group_valid = 0, group_skip = 0;
    for (int64_t r = first_row; r <= rows; r++) {
        int64_t valid = 0, skip = 0;
        if (r < rows) {
            int64_t position = first_position + r / heads;
            valid = tile_valid(position, first_key, num_keys);
            skip = tile_skip(position, first_key, window, sinks);
        }
        int joins = r < rows && group_rows > 0 && group_rows < ROW_GROUP && valid == group_valid && skip == group_skip;
        if (group_rows > 0 && !joins) {
            weigh_values(probabilities, tile->values, group_valid, head_dim / VEC_WIDTH, rescales, outputs, group_rows);
            group_rows = 0;
        }
        if (r == rows || skip >= valid) {
            continue;
        }
        float *scores = scratch->scores + r * KEY_TILE;
        rescales[group_rows] = update_softmax(scores, skip, valid, &scratch->states[r]);
        probabilities[group_rows] = scores;
        outputs[group_rows] = scratch->states[r].output;
        group_rows++;
        group_valid = valid;
        group_skip = skip;
    }
}

/* Queries [first_query, first_query + positions) of `sequence` at query heads [first_head,
 * first_head + heads), all of one KV head, attend over that head's keys; rows ordered by
 * position, then head. */
static void attend_block(const Sequence *sequence, const Shape *shape, int64_t first_query, int64_t positions,
                         int64_t first_head, int64_t heads, Scratch *scratch) {
    int64_t head_dim = shape->head_dim, rows = positions * heads;
    int64_t kv_head = first_head / (shape->num_heads / shape->num_kv_heads);
    int64_t size = element_size(shape->dtype);
    const float **queries = scratch->query_rows;
    int64_t window = sequence->window, sinks = sequence->sink_tokens;
    for (int64_t r = 0; r < rows; r++) {
        int64_t position = first_query + r / heads, head = first_head + r % heads;
        queries[r] = query_row(sequence->query, sequence->query_stride, position, head, shape,
                               scratch->queries + r * head_dim);
        if (sinks > 0) {
            scratch->sink_query_rows[r] = query_row(sequence->sink_query, sequence->query_stride, position, head,
                                                    shape, scratch->sink_queries + r * head_dim);
        }
        RowState *state = &scratch->states[r];
        state->max = -INFINITY;
        memset(state->sums, 0, sizeof state->sums);
        state->output = scratch->outputs + r * head_dim;
        memset(state->output, 0, (size_t)head_dim * sizeof(float));
    }
    KeyValueRows kv = sequence->kv;
    kv.keys = (const char *)kv.keys + kv_head * head_dim * size;
    kv.values = (const char *)kv.values + kv_head * head_dim * size;
    int64_t first_position = sequence->first_position + first_query;
    int64_t last_key = first_position + positions - 1 < kv.count - 1 ? first_position + positions - 1 : kv.count - 1;
    KeyTile tile;
    /* The sinks first, for the rows whose window has left them: one tile of keys 0..sinks-1. */
    if (sinks > 0 && takes_sinks(first_position + positions - 1, window, sinks)) {
        load_tile(&kv, 0, sinks, 0, shape, scratch->key_buffer, scratch->value_buffer, scratch->key_columns,
                  &tile);
        for (int64_t r = 0; r < rows; r++) {
            if (takes_sinks(first_position + r / heads, window, sinks)) {
                int64_t skip = 0;
                float *scores = scratch->scores + r * KEY_TILE;
                score_rows(&scratch->sink_query_rows[r], &tile, &skip, &sinks, head_dim, shape->scale, shape->softcap,
                           &scores, 1);
                float *probabilities = scratch->scores + r * KEY_TILE, *output = scratch->states[r].output;
                vfloat rescale = update_softmax(probabilities, 0, sinks, &scratch->states[r]);
                weigh_values((const float *const *)&probabilities, tile.values, sinks, head_dim / VEC_WIDTH, &rescale,
                             &output, 1);
            }
        }
    }
    /* Tiles stay at fixed positions from key 0 (a row's bits do not depend on its block); those
     * wholly before every row's window are skipped. */
    int64_t first_seen = window_start(first_position, window, sinks);
    for (int64_t first_key = first_seen / KEY_TILE * KEY_TILE; first_key <= last_key; first_key += KEY_TILE) {
        int64_t tile_keys = last_key - first_key + 1 < KEY_TILE ? last_key - first_key + 1 : KEY_TILE;
        load_tile(&kv, first_key, tile_keys, first_seen, shape, scratch->key_buffer, scratch->value_buffer, scratch->key_columns,
                  &tile);
        /* Rows before first_row see none of this tile's keys (causal); a row whose window
         * starts past the tile sees none of it either. */
        int64_t first_row = first_key > first_position ? (first_key - first_position) * heads : 0;
        score_tile_rows(scratch, &tile, first_row, rows, heads, first_position, first_key, kv.count, window, sinks,
                        shape);
        update_rows(scratch, &tile, first_row, rows, heads, first_position, first_key, kv.count, window, sinks,
                    head_dim);
    }
    for (int64_t r = 0; r < rows; r++) {
        int64_t position = first_query + r / heads, head = first_head + r % heads;
        char *out = (char *)sequence->out + (position * sequence->out_stride + head * head_dim) * size;
        finish_row(&scratch->states[r], head_dim, shape->dtype, out);
    }
}

/* Sinks: none, or 1..KEY_TILE of them beside a window, with the queries that score them. */
static int sinks_supported(int64_t sink_tokens, int64_t window, const void *sink_query) {
    return sink_tokens == 0 || (sink_tokens > 0 && sink_tokens <= KEY_TILE && window > 0 && sink_query != NULL);
}

static int shape_supported(const Shape *shape) {
    int64_t head_dim = shape->head_dim;
    return head_dim > 0 && head_dim % VEC_WIDTH == 0 && head_dim <= ATTENTION_MAX_HEAD_DIM
           && shape->num_kv_heads > 0 && shape->num_heads % shape->num_kv_heads == 0;
}

/* out [num_queries, num_heads, head_dim] (contiguous) = causal attention of query
 * [num_queries, num_heads, head_dim] (heads contiguous, rows query_stride apart) over the
 * num_keys K/V rows at `key` and `value`, the queries being the last num_queries positions;
 * with window > 0, each over its last `window` keys only (0: all); with softcap > 0, scaled
 * scores s taken as softcap * tanh(s / softcap).
 * K/V rows: consecutive, key_stride / value_stride elements apart (block_ids NULL); or the
 * slots of a paged cache half (slot s at s * stride) through the sequence's block_ids
 * (num_block_ids of them, blocks of block_size, num_slots slots). float32 or bf16 (`dtype`)
 * throughout. Returns FT_OK; FT_OUT_OF_MEMORY; FT_OUT_OF_BOUNDS (touching nothing) when a block
 * id or num_keys lies outside the cache or the table; FT_BAD_SHAPE for a head size or grouping it
 * does not take. With sink_tokens > 0 (1..KEY_TILE, a window too), sink_query (laid out as
 * query) scores the sinks once a row's window has left them. */
FtStatus ft_flash_attention(const void *query, int64_t query_stride, const void *key, int64_t key_stride,
                            const void *value, int64_t value_stride, const int64_t *block_ids, int64_t num_block_ids,
                            int64_t block_size, int64_t num_slots, int64_t num_queries, int64_t num_keys,
                            int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, float scale, int64_t window,
                            float softcap, int64_t sink_tokens, const void *sink_query, void *out, int dtype,
                            int num_threads) {
    Shape shape = {num_heads, num_kv_heads, head_dim, scale, dtype, softcap};
    if (!shape_supported(&shape) || num_queries < 1 || num_queries > num_keys || window < 0 || softcap < 0
        || !sinks_supported(sink_tokens, window, sink_query)) {
        return FT_BAD_SHAPE;
    }
    if (block_ids != NULL && !tables_in_bounds(num_slots, block_ids, num_block_ids, block_size, &num_keys, 1)) {
        return FT_OUT_OF_BOUNDS;
    }
    Sequence sequence = {query,       query_stride, out,         num_heads * head_dim, num_keys - num_queries,
                         num_queries, window,       sink_tokens, sink_query,
                         {key, value, key_stride, value_stride, block_ids, block_size, num_keys}};
    int64_t group = num_heads / num_kv_heads, blocks = (num_queries + QUERY_BLOCK - 1) / QUERY_BLOCK;
    int64_t work = num_queries * num_keys * num_heads * head_dim;
    int all_allocated = 1;
#pragma omp parallel num_threads(num_threads) if (work >= PARALLEL_MIN_ELEMENTS) reduction(&& : all_allocated)
    {
        Scratch scratch;
        all_allocated = allocate_scratch(&scratch, QUERY_BLOCK * group, head_dim);
        if (all_allocated) {
            /* The last blocks see the most keys: handed out first. */
#pragma omp for schedule(dynamic, 1) nowait
            for (int64_t item = 0; item < blocks * num_kv_heads; item++) {
                int64_t block = blocks - 1 - item / num_kv_heads, kv_head = item % num_kv_heads;
                int64_t first_query = block * QUERY_BLOCK;
                int64_t positions = num_queries - first_query < QUERY_BLOCK ? num_queries - first_query : QUERY_BLOCK;
                attend_block(&sequence, &shape, first_query, positions, kv_head * group, group, &scratch);
            }
            free_scratch(&scratch);
        }
    }
    return all_allocated ? FT_OK : FT_OUT_OF_MEMORY;
}

FT_INTERNAL int64_t decode_heads_per_item(int64_t rows, int64_t num_heads, int64_t num_kv_heads, int num_threads) {
    /* Few rows: one item per query head, so every thread has work; else per KV head, which
     * widens (bf16) and reads each tile once for the whole group. */
    return rows * num_kv_heads < 4 * num_threads ? 1 : num_heads / num_kv_heads;
}

FT_INTERNAL void *decode_attention_scratch(int64_t heads_per_item, int64_t head_dim) {
    Scratch *scratch = malloc(sizeof(Scratch));
    if (scratch != NULL && !allocate_scratch(scratch, heads_per_item, head_dim)) {
        free(scratch);
        return NULL;
    }
    return scratch;
}

FT_INTERNAL void free_decode_attention_scratch(void *scratch) {
    if (scratch != NULL) {
        free_scratch(scratch);
        free(scratch);
    }
}

FT_INTERNAL void decode_attention_share(const DecodeAttention *a, int64_t heads_per_item, void *scratch) {
    int64_t num_heads = a->num_heads, head_dim = a->head_dim, kv_width = a->num_kv_heads * head_dim;
    int64_t size = element_size(a->dtype), items_per_row = num_heads / heads_per_item;
    Shape shape = {num_heads, a->num_kv_heads, head_dim, a->scale, a->dtype, a->softcap};
    const void *values = (const char *)a->kv_cache + a->num_slots * kv_width * size;
#pragma omp for schedule(dynamic, 1) nowait
    for (int64_t item = 0; item < a->rows * items_per_row; item++) {
        int64_t r = item / items_per_row, first_head = (item % items_per_row) * heads_per_item;
        Sequence sequence = {(const char *)a->query + r * a->query_stride * size, 0,
                             (char *)a->out + r * num_heads * head_dim * size, 0, a->seq_lens[r] - 1, 1, a->window,
                             a->sink_tokens,
                             a->sink_query == NULL ? NULL : (const char *)a->sink_query + r * a->query_stride * size,
                             {a->kv_cache, values, kv_width, kv_width, a->block_table + r * a->max_blocks,
                              a->block_size, a->seq_lens[r]}};
        attend_block(&sequence, &shape, 0, 1, first_head, heads_per_item, scratch);
    }
}

FT_INTERNAL int decode_attention_supported(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim) {
    Shape shape = {num_heads, num_kv_heads, head_dim, 1.0f, DTYPE_FLOAT32};
    return shape_supported(&shape);
}

/* out [rows, num_heads, head_dim] (contiguous) = each row's one query (rows query_stride
 * apart, heads contiguous) attending over the first seq_lens[r] keys of its sequence, read in
 * place through block_table [rows, max_blocks] from one layer's cache [2, num_slots, kv_heads
 * * head_dim] in `dtype`: the bits ft_flash_attention gives the last position of a prefill of
 * those keys (with window > 0, the last `window` of them; softcap, sink_tokens and sink_query
 * as ft_flash_attention's). Returns as ft_flash_attention. */
FtStatus ft_flash_decode_attention(const void *query, int64_t query_stride, const void *kv_cache, int64_t num_slots,
                                   const int64_t *block_table, int64_t max_blocks, const int64_t *seq_lens,
                                   int64_t block_size, int64_t rows, int64_t num_heads, int64_t num_kv_heads,
                                   int64_t head_dim, float scale, int64_t window, float softcap, int64_t sink_tokens,
                                   const void *sink_query, void *out, int dtype, int num_threads) {
    if (!decode_attention_supported(num_heads, num_kv_heads, head_dim) || window < 0 || softcap < 0
        || !sinks_supported(sink_tokens, window, sink_query)) {
        return FT_BAD_SHAPE;
    }
    if (!tables_in_bounds(num_slots, block_table, max_blocks, block_size, seq_lens, rows)) {
        return FT_OUT_OF_BOUNDS;
    }
    DecodeAttention attention = {query,   query_stride, kv_cache,  num_slots,    block_table, max_blocks, seq_lens,
                                 block_size, rows,      num_heads, num_kv_heads, head_dim,    scale,      out,
                                 dtype,      window,       softcap,   sink_tokens,  sink_query};
    int64_t heads_per_item = decode_heads_per_item(rows, num_heads, num_kv_heads, num_threads), work = 0;
    for (int64_t r = 0; r < rows; r++) {
        work += seq_lens[r] * num_heads * head_dim;
    }
    int all_allocated = 1;
#pragma omp parallel num_threads(num_threads) if (work >= PARALLEL_MIN_ELEMENTS) reduction(&& : all_allocated)
    {
        void *scratch = decode_attention_scratch(heads_per_item, head_dim);
        all_allocated = scratch != NULL;
        if (all_allocated) {
            decode_attention_share(&attention, heads_per_item, scratch);
            free_decode_attention_scratch(scratch);
        }
    }
    return all_allocated ? FT_OK : FT_OUT_OF_MEMORY;
}

/* Floats per vector in this build: head sizes must be a multiple of it. */
int ft_flash_attention_head_dim_multiple(void) {
    return VEC_WIDTH;
}
