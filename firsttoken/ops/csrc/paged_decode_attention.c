/* Paged decode attention on AVX512-BF16: one new query per sequence over its cached keys,
 * read in place through its block table, in one exact softmax over all keys (no tiles, no
 * online rescaling). A batch's work items are its (sequence, KV head) groups of query heads,
 * which read each key and value once for the whole group (a lone row's are its single heads, so
 * both threads have work); a head's arithmetic is its own either way. The decode step
 * (decode_step.c) attends through the same code, so a decode row gets the same bits on the
 * per-op path and in the whole step.
 *
 * Not the prefill's arithmetic: ft_decode_attention_as_prefill (prefill_attention.c) runs a
 * decode row through the prefill kernel's 64-key tiles and online softmax instead, on purpose,
 * for the bits a prefill of the same tokens gives that position (batch invariance); this one
 * is a little faster where that guarantee is not asked for.
 */
#include "decode_kernels.h"

#if VECTOR_BF16
#define MAX_HEAD_VECTORS (DECODE_MAX_HEAD_DIM / 16)
_Static_assert(DECODE_MAX_HEAD_DIM == 128, "attend_paged_heads has cases for each head size 32, 64, 96, 128");
_Static_assert(DECODE_HEAD_DIM_MULTIPLE == 32, "a chunk of head dims is one VDPBF16PS of query pairs");

/* Keys ahead of the 16 being scored whose rows are fetched meanwhile, with the values of those 16:
 * a context's blocks lie anywhere in the cache, where the hardware's prefetchers do not follow. */
#define PREFETCH_KEYS 64

/* Rows [first, first + count) (count <= 16) of a context's keys or values (`rows`): one division
 * for the group, not one per row. */
static inline __attribute__((always_inline)) void context_rows(const PagedContext *c, const uint16_t *rows,
                                                               int64_t first, int64_t count,
                                                               const uint16_t *pointers[16]) {
    int64_t block = first / c->block_size, offset = first % c->block_size;
    for (int64_t i = 0; i < count; i++) {
        pointers[i] = rows + (c->blocks[block] * c->block_size + offset) * c->kv_width;
        if (++offset == c->block_size) {
            offset = 0;
            block++;
        }
    }
}

/* The rows that exist of [first, first + 16) of a context's keys or values, fetched toward L2.
 * Inlined: GCC drops a call to a function whose only effect is prefetching, as a pure one's. */
static inline __attribute__((always_inline)) void prefetch_sixteen(const PagedContext *c, const uint16_t *rows,
                                                                   int64_t first, int64_t head_dim) {
    int64_t count = c->seq_len - first < 16 ? c->seq_len - first : 16;
    const uint16_t *pointers[16];
    context_rows(c, rows, first, count, pointers);
    for (int64_t i = 0; i < count; i++) {
        for (int64_t offset = 0; offset < head_dim * (int64_t)sizeof(uint16_t); offset += 64) {
            _mm_prefetch((const char *)pointers[i] + offset, _MM_HINT_T1);
        }
    }
}

/* Lane k: the sum of the 16 lanes of dots[k], added in the pairs _mm512_reduce_add_ps adds one
 * vector's lanes in (i with i + 8, then i with i + 4 of those, i with i + 2, then the two left),
 * for a quarter of its instructions per key: the scores kept the bits they had when each key
 * was reduced alone. */
static inline __attribute__((always_inline)) __m512 reduce_sixteen(const __m512 dots[16]) {
    __m512 pairs[8], quads[4], octets[2];
    for (int i = 0; i < 8; i++) { /* lanes 0-7: key 2i's eight sums, 8-15: key 2i + 1's */
        pairs[i] = _mm512_add_ps(_mm512_shuffle_f32x4(dots[2 * i], dots[2 * i + 1], 0x44),
                                 _mm512_shuffle_f32x4(dots[2 * i], dots[2 * i + 1], 0xee));
    }
    for (int i = 0; i < 4; i++) { /* quarter q: key 4i + q's four sums */
        quads[i] = _mm512_add_ps(_mm512_shuffle_f32x4(pairs[2 * i], pairs[2 * i + 1], 0x88),
                                 _mm512_shuffle_f32x4(pairs[2 * i], pairs[2 * i + 1], 0xdd));
    }
    for (int i = 0; i < 2; i++) { /* quarter q: key 8i + q's two sums, then key 8i + 4 + q's */
        __m512d low = _mm512_castps_pd(quads[2 * i]), high = _mm512_castps_pd(quads[2 * i + 1]);
        octets[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(low, high)),
                                  _mm512_castpd_ps(_mm512_unpackhi_pd(low, high)));
    }
    /* quarter q, lane m: key q + 4m */
    __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(octets[0], octets[1], 0x88),
                                _mm512_shuffle_ps(octets[0], octets[1], 0xdd));
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), sums);
}

/* `heads` query heads (queries and outputs head_dim apart) over the paged context of the KV head
 * they share: scores in float32, softmax, the probabilities rounded to bf16 before they weigh V
 * (as torch's flash kernel does). Each key and value is read once for all of them; each head's
 * arithmetic is its own, in a fixed key order, so its result does not depend on the other heads
 * or on what else is in the batch. `vectors` (head_dim / 16) and `heads` are compile-time
 * constants at each call site, so the query pairs and output accumulators stay in registers.
 * `scores` holds heads * (seq_len + 16) floats. */
static inline __attribute__((always_inline)) void attend_heads(const uint16_t *queries, const PagedContext *c,
                                                               float scale, float *scores, uint16_t *destinations,
                                                               const int64_t vectors, const int heads) {
    int64_t seq_len = c->seq_len, score_stride = seq_len + 16, head_dim = 16 * vectors;
    __m512bh query_pairs[PAGED_HEADS_PER_PASS][MAX_HEAD_VECTORS / 2];
    __m512 maxima[PAGED_HEADS_PER_PASS];
    for (int h = 0; h < heads; h++) {
        for (int64_t v = 0; v < vectors / 2; v++) {
            query_pairs[h][v] = (__m512bh)_mm512_loadu_si512(queries + h * head_dim + 32 * v);
        }
        maxima[h] = _mm512_set1_ps(-INFINITY);
    }
    for (int64_t first = 0; first < seq_len; first += 16) {
        int64_t count = seq_len - first < 16 ? seq_len - first : 16;
        if (first + PREFETCH_KEYS < seq_len) {
            prefetch_sixteen(c, c->keys, first + PREFETCH_KEYS, head_dim);
        }
        prefetch_sixteen(c, c->values, first, head_dim);
        const uint16_t *keys[16];
        context_rows(c, c->keys, first, count, keys);
        __m512 dots[PAGED_HEADS_PER_PASS][16];
        for (int64_t k = 0; k < 16; k++) {
            if (k >= count) {
                for (int h = 0; h < heads; h++) {
                    dots[h][k] = _mm512_setzero_ps();
                }
                continue;
            }
            __m512bh key_pairs[MAX_HEAD_VECTORS / 2];
            for (int64_t v = 0; v < vectors / 2; v++) {
                key_pairs[v] = (__m512bh)_mm512_loadu_si512(keys[k] + 32 * v);
            }
            for (int h = 0; h < heads; h++) {
                __m512 dot = _mm512_setzero_ps();
                for (int64_t v = 0; v < vectors / 2; v++) {
                    dot = _mm512_dpbf16_ps(dot, query_pairs[h][v], key_pairs[v]);
                }
                dots[h][k] = dot;
            }
        }
        __mmask16 lanes = tail_mask(count);
        for (int h = 0; h < heads; h++) {
            __m512 block = _mm512_mul_ps(reduce_sixteen(dots[h]), _mm512_set1_ps(scale));
            _mm512_mask_storeu_ps(scores + h * score_stride + first, lanes, block);
            maxima[h] = _mm512_mask_max_ps(maxima[h], lanes, maxima[h], block);
        }
    }
    __m512 inverse_sums[PAGED_HEADS_PER_PASS];
    for (int h = 0; h < heads; h++) {
        float *head_scores = scores + h * score_stride;
        __m512 maximum = _mm512_set1_ps(_mm512_reduce_max_ps(maxima[h]));
        __m512 sum = _mm512_setzero_ps();
        for (int64_t j = 0; j < seq_len; j += 16) {
            __mmask16 lanes = tail_mask(seq_len - j);
            __m512 weight = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, head_scores + j), maximum));
            weight = _mm512_maskz_mov_ps(lanes, weight);
            sum = _mm512_add_ps(sum, weight);
            __m256i rounded = round16_bf16(weight);
            _mm512_mask_storeu_ps(head_scores + j, lanes,
                                  _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(rounded), 16)));
        }
        inverse_sums[h] = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum));
    }
    __m512 output[PAGED_HEADS_PER_PASS][MAX_HEAD_VECTORS];
    for (int h = 0; h < heads; h++) {
        for (int64_t v = 0; v < vectors; v++) {
            output[h][v] = _mm512_setzero_ps();
        }
    }
    for (int64_t first = 0; first < seq_len; first += 16) {
        int64_t count = seq_len - first < 16 ? seq_len - first : 16;
        const uint16_t *value_rows[16];
        context_rows(c, c->values, first, count, value_rows);
        for (int64_t k = 0; k < count; k++) {
            __m512 values[MAX_HEAD_VECTORS];
            for (int64_t v = 0; v < vectors; v++) {
                values[v] = load16_bf16(value_rows[k] + 16 * v, 0xffff);
            }
            for (int h = 0; h < heads; h++) {
                __m512 weight = _mm512_set1_ps(scores[h * score_stride + first + k]);
                for (int64_t v = 0; v < vectors; v++) {
                    output[h][v] = _mm512_fmadd_ps(values[v], weight, output[h][v]);
                }
            }
        }
    }
    for (int h = 0; h < heads; h++) {
        for (int64_t v = 0; v < vectors; v++) {
            _mm256_storeu_si256((__m256i *)(destinations + h * head_dim + 16 * v),
                                round16_bf16(_mm512_mul_ps(output[h][v], inverse_sums[h])));
        }
    }
}

/* Heads in one pass over the context for `vectors` (head_dim / 16): as many as keep their query
 * pairs, output accumulators and a value's vectors in the 32 registers. */
static inline int64_t heads_per_pass(int64_t vectors) {
    return vectors <= 4 ? PAGED_HEADS_PER_PASS : 2;
}

FT_INTERNAL void attend_paged_heads(const uint16_t *queries, int64_t heads, const PagedContext *context,
                                    int64_t head_dim, float scale, float *scores, uint16_t *destinations) {
    int64_t vectors = head_dim / 16, per_pass = heads_per_pass(vectors);
    for (int64_t first = 0; first < heads; first += per_pass) {
        int64_t count = heads - first < per_pass ? heads - first : per_pass;
        const uint16_t *pass_queries = queries + first * head_dim;
        uint16_t *pass_destinations = destinations + first * head_dim;
        switch (vectors * 8 + count) {
#define HEADS_CASE(dims, count) \
    case (dims / 16) * 8 + count: \
        attend_heads(pass_queries, context, scale, scores, pass_destinations, dims / 16, count); \
        break;
            HEADS_CASE(32, 1) HEADS_CASE(32, 2) HEADS_CASE(32, 3) HEADS_CASE(32, 4)
            HEADS_CASE(64, 1) HEADS_CASE(64, 2) HEADS_CASE(64, 3) HEADS_CASE(64, 4)
            HEADS_CASE(96, 1) HEADS_CASE(96, 2)
            HEADS_CASE(128, 1) HEADS_CASE(128, 2)
#undef HEADS_CASE
        }
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
    int64_t heads_per_item = decode_heads_per_item(rows, num_heads, num_kv_heads, num_threads);
    int64_t items_per_row = num_heads / heads_per_item;
    /* A thread takes a sequence's items one after another where there are sequences enough to
     * share: its KV heads lie side by side in each slot, so the lines the hardware fetches
     * around one KV head's keys serve the next (SmolLM2, 8 rows: 0.8x the time of items
     * interleaved over the threads). */
    int64_t chunk = rows >= 2 * num_threads ? items_per_row : 1;
    int64_t scores_per_thread = PAGED_HEADS_PER_PASS * (max_seq_len + 16);
    float *scores = malloc((size_t)(num_threads * scores_per_thread) * sizeof(float));
    if (scores == NULL) {
        return FT_OUT_OF_MEMORY;
    }
#pragma omp parallel num_threads(num_threads) if (rows * num_heads * max_seq_len * head_dim >= 4 * PARALLEL_MIN_ELEMENTS)
    {
        float *thread_scores = scores + omp_get_thread_num() * scores_per_thread;
        /* dynamic: sequences of different lengths make items of different cost */
#pragma omp for schedule(dynamic, chunk)
        for (int64_t item = 0; item < rows * items_per_row; item++) {
            int64_t sequence = item / items_per_row, head = item % items_per_row * heads_per_item;
            PagedContext context = paged_context(kv_cache, num_slots, num_heads, num_kv_heads, head_dim, block_table,
                                                 max_blocks, block_size, seq_lens, sequence, head);
            attend_paged_heads(query + sequence * query_stride + head * head_dim, heads_per_item, &context, head_dim,
                               scale, thread_scores, out + (sequence * num_heads + head) * head_dim);
        }
    }
    free(scores);
    return FT_OK;
}
#endif
