/* Paged decode attention on AVX512-BF16: one new query per sequence over its cached keys,
 * read in place through its block table, in one exact softmax over all keys (no tiles, no
 * online rescaling). The decode step (decode_step.c) attends through the same code, so a
 * decode row gets the same bits on the per-op path and in the whole step.
 *
 * Not the prefill's arithmetic: ft_decode_attention_as_prefill (prefill_attention.c) runs a
 * decode row through the prefill kernel's 64-key tiles and online softmax instead, on purpose,
 * for the bits a prefill of the same tokens gives that position (batch invariance); this one
 * is a little faster where that guarantee is not asked for.
 */
#include "decode_kernels.h"

#if VECTOR_BF16
#define MAX_HEAD_VECTORS (DECODE_MAX_HEAD_DIM / 16)
_Static_assert(DECODE_MAX_HEAD_DIM == 128, "attend_paged has a case for each head size 32, 64, 96, 128");
_Static_assert(DECODE_HEAD_DIM_MULTIPLE == 32, "a chunk of head dims is one VDPBF16PS of query pairs");

/* One query head over its paged context: scores in float32, softmax, the probabilities
 * rounded to bf16 before they weigh V (as torch's flash kernel does). Each head of each
 * sequence is computed alone, in a fixed key order: its result does not depend on what else
 * is in the batch. `vectors` (head_dim / 16) is a compile-time constant at each call site, so
 * the output accumulators stay in registers. `scores` holds seq_len + 16 floats. */
static inline __attribute__((always_inline)) void attend_paged_vectors(const uint16_t *query, const PagedContext *c,
                                                                      float scale, float *scores,
                                                                      uint16_t *destination, const int64_t vectors) {
    int64_t seq_len = c->seq_len, block_size = c->block_size;
    __m512bh query_pairs[MAX_HEAD_VECTORS / 2];
    for (int64_t v = 0; v < vectors / 2; v++) {
        query_pairs[v] = (__m512bh)_mm512_loadu_si512(query + 32 * v);
    }
    float maximum = -INFINITY;
    for (int64_t j = 0; j < seq_len; j++) {
        const uint16_t *key = c->keys + (c->blocks[j / block_size] * block_size + j % block_size) * c->kv_width;
        __m512 dot = _mm512_setzero_ps();
        for (int64_t v = 0; v < vectors / 2; v++) {
            dot = _mm512_dpbf16_ps(dot, query_pairs[v], (__m512bh)_mm512_loadu_si512(key + 32 * v));
        }
        scores[j] = _mm512_reduce_add_ps(dot) * scale;
        maximum = scores[j] > maximum ? scores[j] : maximum;
    }
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < seq_len; j += 16) {
        __mmask16 lanes = tail_mask(seq_len - j);
        __m512 weight = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, scores + j), _mm512_set1_ps(maximum)));
        weight = _mm512_maskz_mov_ps(lanes, weight);
        sum = _mm512_add_ps(sum, weight);
        __m256i rounded = round16_bf16(weight);
        _mm512_mask_storeu_ps(scores + j, lanes, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(rounded), 16)));
    }
    __m512 output[MAX_HEAD_VECTORS];
    for (int64_t v = 0; v < vectors; v++) {
        output[v] = _mm512_setzero_ps();
    }
    for (int64_t j = 0; j < seq_len; j++) {
        const uint16_t *value = c->values + (c->blocks[j / block_size] * block_size + j % block_size) * c->kv_width;
        __m512 weight = _mm512_set1_ps(scores[j]);
        for (int64_t v = 0; v < vectors; v++) {
            output[v] = _mm512_fmadd_ps(load16_bf16(value + 16 * v, 0xffff), weight, output[v]);
        }
    }
    __m512 inverse_sum = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum));
    for (int64_t v = 0; v < vectors; v++) {
        _mm256_storeu_si256((__m256i *)(destination + 16 * v), round16_bf16(_mm512_mul_ps(output[v], inverse_sum)));
    }
}

FT_INTERNAL void attend_paged(const uint16_t *query, const PagedContext *context, int64_t head_dim, float scale,
                         float *scores, uint16_t *destination) {
    switch (head_dim) {
#define HEAD_DIM_CASE(dims) \
    case dims: \
        attend_paged_vectors(query, context, scale, scores, destination, dims / 16); \
        break;
        HEAD_DIM_CASE(32)
        HEAD_DIM_CASE(64)
        HEAD_DIM_CASE(96)
        HEAD_DIM_CASE(128)
#undef HEAD_DIM_CASE
    }
}

/* Sequence `sequence`'s context at the KV head that query head `head` reads. */
FT_INTERNAL PagedContext paged_context(const uint16_t *kv_cache, int64_t num_slots, int64_t num_heads, int64_t num_kv_heads,
                                  int64_t head_dim, const int64_t *block_table, int64_t max_blocks,
                                  int64_t block_size, const int64_t *seq_lens, int64_t sequence, int64_t head) {
    int64_t kv_width = num_kv_heads * head_dim, kv_head = head / (num_heads / num_kv_heads);
    const uint16_t *keys = kv_cache + kv_head * head_dim;
    PagedContext context = {keys, keys + num_slots * kv_width, kv_width, block_table + sequence * max_blocks,
                            block_size, seq_lens[sequence]};
    return context;
}

/* out [rows, num_heads, head_dim] = each row's single query (rows of query, query_stride
 * apart, heads contiguous) attending over its sequence's first seq_lens[r] keys, read through
 * block_table [rows, max_blocks] from one layer's bf16 cache [2, num_slots, kv_heads *
 * head_dim]: the decode rows of a step that also prefills, or of one too wide for the whole
 * step, with no gather of the context. Returns FT_OK, FT_OUT_OF_MEMORY, or
 * FT_OUT_OF_BOUNDS (touching nothing) when a block id or length lies outside the cache. */
FtStatus ft_paged_decode_attention(const uint16_t *query, int64_t query_stride, const uint16_t *kv_cache,
                                   int64_t num_slots, const int64_t *block_table, int64_t max_blocks, const int64_t *seq_lens,
                                   int64_t block_size, int64_t rows, int64_t num_heads, int64_t num_kv_heads,
                                   int64_t head_dim, float scale, uint16_t *out, int num_threads) {
    if (!tables_in_bounds(num_slots, block_table, max_blocks, block_size, seq_lens, rows)) {
        return FT_OUT_OF_BOUNDS;
    }
    int64_t max_seq_len = 1;
    for (int64_t r = 0; r < rows; r++) {
        max_seq_len = max_i64(max_seq_len, seq_lens[r]);
    }
    int64_t scores_per_thread = max_seq_len + 16;
    float *scores = malloc((size_t)(num_threads * scores_per_thread) * sizeof(float));
    if (scores == NULL) {
        return FT_OUT_OF_MEMORY;
    }
#pragma omp parallel num_threads(num_threads) if (rows * num_heads * max_seq_len * head_dim >= 4 * PARALLEL_MIN_ELEMENTS)
    {
        float *thread_scores = scores + omp_get_thread_num() * scores_per_thread;
        /* dynamic: sequences of different lengths make items of different cost */
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < rows * num_heads; item++) {
            int64_t sequence = item / num_heads, head = item % num_heads;
            PagedContext context = paged_context(kv_cache, num_slots, num_heads, num_kv_heads, head_dim, block_table,
                                                 max_blocks, block_size, seq_lens, sequence, head);
            attend_paged(query + sequence * query_stride + head * head_dim, &context, head_dim, scale, thread_scores,
                         out + item * head_dim);
        }
    }
    free(scores);
    return FT_OK;
}
#endif
