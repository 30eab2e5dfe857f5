/* What the whole-step decodes share: the layer both run (portable_decode_step.c), and the
 * kernels they run inside its parallel region: the float32 step the portable int4 projection
 * (quantized_matmul.c) and flash decode attention (attention.c); the AVX512-BF16 step
 * (decode_step.c) that build's int4 projection (quantized_matmul_bf16.c) and paged decode
 * attention (paged_decode_attention.c). */
#ifndef FIRSTTOKEN_DECODE_KERNELS_H
#define FIRSTTOKEN_DECODE_KERNELS_H

#include "common.h"

/* What one whole-step decode runs that the other does not: its activations' dtype, and the
 * kernels of its projections and attention. The layer around them is written once, in
 * decode_layers. Each kernel runs this OpenMP thread's share, with no barrier at its end (the
 * layer puts one after it); a call per projection, the hot loops inside. */
typedef struct {
    int dtype;
    /* This thread's scratch for project and attend, NULL when out of memory; freed by
     * free_scratch (which takes NULL). */
    void *(*thread_scratch)(const DecodeModel *m, const DecodeBatch *b, int num_threads);
    void (*free_scratch)(void *scratch);
    /* out [rows, w->out_features] = x [rows, w->in_features] . W^T (+ bias). */
    void (*project)(const Int4Weight *w, const void *x, int64_t rows, void *scratch, void *out);
    /* attended [rows, heads * head_dim] from the rotated queries in qkv [rows, (heads + 2 kv_heads)
     * * head_dim] over the layer's cache, the new keys already in it. */
    void (*attend)(const DecodeModel *m, const DecodeLayer *layer, const DecodeBatch *b, const void *qkv,
                   void *attended, void *scratch);
} DecodeStepKernels;

/* Every layer of `m` (portable_decode_step.c) for one new token per sequence of `b`, on `kernels`
 * and num_threads threads: `hidden` [rows, hidden_size] holds the tokens' embeddings on entry and
 * the last layer's output plus its residual on return; each layer's K/V go into its cache at the
 * batch's slots. Returns FT_OK, FT_OUT_OF_MEMORY, or FT_OUT_OF_BOUNDS (touching nothing) when a
 * slot, block id or length lies outside the cache or there are more than DECODE_MAX_ROWS sequences. */
FT_INTERNAL FtStatus decode_layers(const DecodeStepKernels *kernels, const DecodeModel *m, const DecodeBatch *b,
                                   void *hidden, int num_threads);
/* The widest input a projection of the step reads. */
FT_INTERNAL int64_t decode_widest_input(const DecodeModel *m);

/* Per row of float32 x [rows, in_features] (in_features a multiple of INT4_GROUP_SIZE), the sum
 * of each group's inputs into `sums` [rows, in_features / INT4_GROUP_SIZE]. */
FT_INTERNAL void portable_int4_input_sums(const float *x, int64_t rows, int64_t in_features, float *sums);

/* This OpenMP thread's share of out [rows, out_features] = x . W^T (+ bias) in `dtype`, x float32
 * with its group sums from portable_int4_input_sums, 1 <= rows <= DECODE_MAX_ROWS. */
FT_INTERNAL void portable_int4_share(const Int4Weight *w, const float *x, const float *input_sums, int64_t rows,
                                     int dtype, void *out);

/* One query per sequence over its paged cache: ft_flash_decode_attention's parameters. */
typedef struct {
    const void *query;
    int64_t query_stride;
    const void *kv_cache; /* [2, num_slots, num_kv_heads * head_dim] */
    int64_t num_slots;
    const int64_t *block_table; /* [rows, max_blocks] */
    int64_t max_blocks;
    const int64_t *seq_lens; /* [rows] */
    int64_t block_size, rows, num_heads, num_kv_heads, head_dim;
    float scale;
    void *out; /* [rows, num_heads, head_dim] */
    int dtype;
    int64_t window; /* > 0: each row sees its last `window` keys only */
    float softcap;  /* > 0: scaled scores soft-capped */
    int64_t sink_tokens;    /* > 0: StreamingLLM's sinks beside the window */
    const void *sink_query; /* as query: the rows that score the sinks */
} DecodeAttention;

/* Whether the flash decode attention takes this head shape. */
FT_INTERNAL int decode_attention_supported(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim);
/* Query heads a work item takes for this many rows on this many threads (a row's bits do not
 * depend on it). */
FT_INTERNAL int64_t decode_heads_per_item(int64_t rows, int64_t num_heads, int64_t num_kv_heads, int num_threads);
/* A thread's scratch for decode_attention_share, NULL when out of memory; freed by
 * free_decode_attention_scratch (which takes NULL). */
FT_INTERNAL void *decode_attention_scratch(int64_t heads_per_item, int64_t head_dim);
FT_INTERNAL void free_decode_attention_scratch(void *scratch);
/* This thread's items of the attention (no barrier at the end). */
FT_INTERNAL void decode_attention_share(const DecodeAttention *attention, int64_t heads_per_item, void *scratch);

#if VECTOR_BF16
/* Per row of x [rows, in_features] (in_features a multiple of INT4_INPUT_MULTIPLE): x with
 * its inputs reordered for the int4 kernel into `paired`, and each group's sum into `sums`. */
FT_INTERNAL void prepare_inputs(const uint16_t *x, int64_t rows, int64_t in_features, uint16_t *paired, float *sums);

/* This OpenMP thread's share of out [rows, out_features] = x . W^T (bf16), rows <=
 * DECODE_MAX_ROWS, from prepare_inputs' `paired` and `sums`; `row_scales` scratch of 2 *
 * groups floats. */
FT_INTERNAL void int4_share(const Int4Weight *w, const uint16_t *paired, const float *sums, int64_t rows,
                            float *row_scales, uint16_t *out);

/* One sequence's cached K and V at one KV head, read through its block table. */
typedef struct {
    const uint16_t *keys;   /* the cache's keys at this KV head: slot s at keys + s * kv_width */
    const uint16_t *values; /* likewise */
    int64_t kv_width;       /* kv_heads * head_dim */
    const int64_t *blocks;  /* the sequence's block ids */
    int64_t block_size;
    int64_t seq_len;        /* keys to attend over */
} PagedContext;

/* Sequence `sequence`'s context at the KV head that query head `head` reads. */
FT_INTERNAL PagedContext paged_context(const uint16_t *kv_cache, int64_t num_slots, int64_t num_heads,
                                       int64_t num_kv_heads, int64_t head_dim, const int64_t *block_table,
                                       int64_t max_blocks, int64_t block_size, const int64_t *seq_lens,
                                       int64_t sequence, int64_t head);

/* Query heads attend_paged_heads takes in one pass over a context (fewer for heads over 64). */
#define PAGED_HEADS_PER_PASS 4

/* `heads` query heads that read one KV head (head_dim a multiple of DECODE_HEAD_DIM_MULTIPLE up to
 * DECODE_MAX_HEAD_DIM; queries and destinations head_dim apart) over its paged context into
 * `destinations`; `scores` holds PAGED_HEADS_PER_PASS * (seq_len + 16) floats. */
FT_INTERNAL void attend_paged_heads(const uint16_t *queries, int64_t heads, const PagedContext *context,
                                    int64_t head_dim, float scale, float *scores, uint16_t *destinations);
#endif

#endif
