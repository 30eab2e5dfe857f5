/* What the decode step (decode_step.c) shares with the AVX512-BF16 int4 projection
 * (quantized_matmul_bf16.c) and the paged decode attention (paged_decode_attention.c): it
 * runs their code inside its own parallel region. */
#ifndef FIRSTTOKEN_DECODE_KERNELS_H
#define FIRSTTOKEN_DECODE_KERNELS_H

#include "common.h"

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

/* One query head (head_dim a multiple of DECODE_HEAD_DIM_MULTIPLE up to DECODE_MAX_HEAD_DIM)
 * over its paged context into `destination`; `scores` holds seq_len + 16 floats. */
FT_INTERNAL void attend_paged(const uint16_t *query, const PagedContext *context, int64_t head_dim, float scale,
                              float *scores, uint16_t *destination);
#endif

#endif
