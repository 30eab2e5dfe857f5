/* A whole decode step of a Llama-family model with int4 weights, in one call.
 *
 * A decode step reads every weight once for a handful of tokens: its time is the weights'
 * bytes plus, in torch, about ten small ops per projection and per norm that each cost more
 * to dispatch than to compute. Here the layers run back to back inside one OpenMP region on
 * torch's own threads (projections split by output rows, attention by query heads), with
 * bf16 activations rounded exactly where the per-op path rounds them:
 *   (add +) RMSNorm -> QKV -> rotary -> KV write -> attention -> O -> add + RMSNorm
 *   -> gate/up -> SiLU * up -> down, and finally hidden + residual.
 *
 * int4 weights: groups of 32 inputs, w = (level - 8) * scale + zero (PyTorch's convention),
 * levels 0..15 packed two per byte (byte j of a group: level j low, level j + 16 high),
 * bf16 scales and zeros. x . w = sum over groups of scale * (levels . x) + (zero - 8 scale)
 * * sum(x): the levels become bf16 128 + level by one OR of their bits and meet x in
 * VDPBF16PS two groups at a time (exact products, float32 sums), the extra 128 folded into
 * the offsets.
 *
 * Also the int8 projection (per-row scales) for decode-sized steps: the quantized LM head.
 */
#include "common.h"

#if VECTOR_BF16
#define INT4_GROUP 32
#define MAX_HEAD_VECTORS (DECODE_MAX_HEAD_DIM / 16)
_Static_assert(DECODE_MAX_ROWS == 8, "DISPATCH_ROWS has a case for each row count 1 to 8");
_Static_assert(DECODE_MAX_HEAD_DIM == 128, "attend_head has a case for each head size 32, 64, 96, 128");

/* BLOCK(n) with n the compile-time constant equal to `rows` (1 to DECODE_MAX_ROWS), so that
 * a kernel's per-row accumulators stay in registers. */
#define DISPATCH_ROWS(rows, BLOCK) \
    switch (rows) { \
    case 1: BLOCK(1); break; \
    case 2: BLOCK(2); break; \
    case 3: BLOCK(3); break; \
    case 4: BLOCK(4); break; \
    case 5: BLOCK(5); break; \
    case 6: BLOCK(6); break; \
    case 7: BLOCK(7); break; \
    case 8: BLOCK(8); break; \
    }

/* Int4Weight, DecodeLayer, DecodeModel and DecodeBatch, the structs Python fills, come from
 * native_abi.h. */

/* Two groups' levels as bf16 128 + level (0x4300 is 128.0 and a level fits its mantissa):
 * `low` holds levels 0-15 of both groups, `high` levels 16-31, the first group in lanes 0-15. */
static inline void pair_levels(const uint8_t *packed, __m512bh *low, __m512bh *high) {
    __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)packed));
    __m512i bias = _mm512_set1_epi16(0x4300);
    /* (bytes & 0x0f) | 0x4300 in one ternary-logic op */
    *low = (__m512bh)_mm512_ternarylogic_epi32(bytes, _mm512_set1_epi16(0x0f), bias, 0xea);
    *high = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(bytes, 4), bias);
}

/* Per row of x: x with the middle quarters of every 64 inputs swapped, so that lanes line
 * up with `pair_levels` (inputs 0-15 of both groups, then 16-31 of both), and the sum of each
 * group of 32 inputs, the term the offsets multiply. in_features is a multiple of 64. */
static void prepare_inputs(const uint16_t *x, int64_t rows, int64_t in_features, uint16_t *paired, float *sums) {
    int64_t groups = in_features / INT4_GROUP;
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *row = x + r * in_features;
        uint16_t *destination = paired + r * in_features;
        for (int64_t i = 0; i < in_features; i += 2 * INT4_GROUP) {
            memcpy(destination + i, row + i, 32);
            memcpy(destination + i + 16, row + i + 32, 32);
            memcpy(destination + i + 32, row + i + 16, 32);
            memcpy(destination + i + 48, row + i + 48, 32);
        }
        for (int64_t g = 0; g < groups; g++) {
            const uint16_t *group = row + g * INT4_GROUP;
            __m512 total = _mm512_add_ps(load16_bf16(group, 0xffff), load16_bf16(group + 16, 0xffff));
            sums[r * groups + g] = _mm512_reduce_add_ps(total);
        }
    }
}

/* out[r, o] for o in [begin, end): `rows` is a compile-time constant at each call site, so
 * the accumulators stay in registers. The levels enter as 128 + level, so each group's
 * offset (zero - 8 scale) loses another 128 scales. */
static inline __attribute__((always_inline)) void int4_block(const Int4Weight *w, const uint16_t *paired,
                                                              const float *sums, const int64_t rows, int64_t begin,
                                                              int64_t end, float *row_scales, uint16_t *out) {
    int64_t in_features = w->in_features, groups = in_features / INT4_GROUP;
    float *offsets = row_scales + groups;
    for (int64_t o = begin; o < end; o++) {
        const uint16_t *scales_zeros = w->scales_zeros + o * 2 * groups;
        for (int64_t g = 0; g < groups; g += 16) {
            __mmask16 lanes = tail_mask(groups - g);
            __m512 scale = load16_bf16(scales_zeros + g, lanes);
            __m512 zero = load16_bf16(scales_zeros + groups + g, lanes);
            _mm512_mask_storeu_ps(row_scales + g, lanes, scale);
            _mm512_mask_storeu_ps(offsets + g, lanes, _mm512_fnmadd_ps(_mm512_set1_ps(136.0f), scale, zero));
        }
        const uint8_t *levels = w->levels + o * (in_features / 2);
        __m512 totals[DECODE_MAX_ROWS];
        for (int64_t r = 0; r < rows; r++) {
            totals[r] = _mm512_setzero_ps();
        }
        for (int64_t g = 0; g < groups; g += 2) {
            __m512bh low, high;
            pair_levels(levels + g * (INT4_GROUP / 2), &low, &high);
            __m512 scale = _mm512_mask_broadcastss_ps(_mm512_set1_ps(row_scales[g]), 0xff00,
                                                      _mm_load_ss(row_scales + g + 1));
            for (int64_t r = 0; r < rows; r++) {
                const uint16_t *inputs = paired + r * in_features + g * INT4_GROUP;
                __m512 product = _mm512_dpbf16_ps(_mm512_setzero_ps(), low, (__m512bh)_mm512_loadu_si512(inputs));
                product = _mm512_dpbf16_ps(product, high, (__m512bh)_mm512_loadu_si512(inputs + 32));
                totals[r] = _mm512_fmadd_ps(product, scale, totals[r]);
            }
        }
        for (int64_t r = 0; r < rows; r++) {
            __m512 offset_terms = _mm512_setzero_ps();
            for (int64_t g = 0; g < groups; g += 16) {
                __mmask16 lanes = tail_mask(groups - g);
                offset_terms = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(lanes, offsets + g),
                                               _mm512_maskz_loadu_ps(lanes, sums + r * groups + g), offset_terms);
            }
            float value = bf16_to_float(float_to_bf16(_mm512_reduce_add_ps(_mm512_add_ps(totals[r], offset_terms))));
            if (w->bias != NULL) {
                value += bf16_to_float(w->bias[o]);
            }
            out[r * w->out_features + o] = float_to_bf16(value);
        }
    }
}

/* This thread's share of out [rows, out_features] = x [rows, in_features] . W^T (bf16),
 * rows <= DECODE_MAX_ROWS; `paired` and `sums` from prepare_inputs; `row_scales` scratch of
 * 2 * groups floats. */
static void int4_share(const Int4Weight *w, const uint16_t *paired, const float *sums, int64_t rows,
                       float *row_scales, uint16_t *out) {
    int64_t begin, end;
    thread_rows(w->out_features, &begin, &end);
#define INT4_BLOCK(n) int4_block(w, paired, sums, n, begin, end, row_scales, out)
    DISPATCH_ROWS(rows, INT4_BLOCK)
#undef INT4_BLOCK
}

/* out = x . W^T for x contiguous bf16 [rows, in_features], rows <= DECODE_MAX_ROWS,
 * in_features a multiple of 64, out contiguous bf16 [rows, out_features]. Returns FT_OUT_OF_MEMORY
 * when out of memory. */
FtStatus ft_int4_matmul(const uint8_t *levels, const uint16_t *scales_zeros, const uint16_t *bias, int64_t out_features,
                        int64_t in_features, const uint16_t *x, int64_t rows, uint16_t *out, int num_threads) {
    Int4Weight weight = {levels, scales_zeros, bias, out_features, in_features};
    int64_t groups = in_features / INT4_GROUP;
    float *sums = malloc((size_t)(rows * groups) * sizeof(float) + (size_t)(rows * in_features) * sizeof(uint16_t));
    if (sums == NULL) {
        return FT_OUT_OF_MEMORY;
    }
    uint16_t *paired = (uint16_t *)(sums + rows * groups);
    prepare_inputs(x, rows, in_features, paired, sums);
    int succeeded = 1;
#pragma omp parallel num_threads(num_threads) if (out_features * in_features >= 4 * PARALLEL_MIN_ELEMENTS) \
    reduction(&& : succeeded)
    {
        float *row_scales = malloc((size_t)(2 * groups) * sizeof(float));
        succeeded = row_scales != NULL;
        if (succeeded) {
            int4_share(&weight, paired, sums, rows, row_scales, out);
        }
        free(row_scales);
    }
    free(sums);
    return succeeded ? FT_OK : FT_OUT_OF_MEMORY;
}

/* out[r, o] = scale[o] * (x[r] . W[o]) for int8 W [out, in] (in a multiple of 16), x
 * contiguous bf16 [rows <= DECODE_MAX_ROWS, in], bf16 scales, out bf16 [rows, out]; `inputs`
 * holds x in float32. `rows` is a compile-time constant at each call site. */
static inline __attribute__((always_inline)) void int8_block(const int8_t *weight, const uint16_t *scales,
                                                              const uint16_t *bias, int64_t out_features,
                                                              int64_t in_features, const float *inputs,
                                                              const int64_t rows, int64_t begin, int64_t end,
                                                              uint16_t *out) {
    for (int64_t o = begin; o < end; o++) {
        const int8_t *row = weight + o * in_features;
        __m512 totals[DECODE_MAX_ROWS];
        for (int64_t r = 0; r < rows; r++) {
            totals[r] = _mm512_setzero_ps();
        }
        for (int64_t i = 0; i < in_features; i += 16) {
            __m512 weights = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + i))));
            for (int64_t r = 0; r < rows; r++) {
                totals[r] = _mm512_fmadd_ps(weights, _mm512_loadu_ps(inputs + r * in_features + i), totals[r]);
            }
        }
        float scale = bf16_to_float(scales[o]);
        for (int64_t r = 0; r < rows; r++) {
            float value = bf16_to_float(float_to_bf16(_mm512_reduce_add_ps(totals[r]) * scale));
            if (bias != NULL) {
                value += bf16_to_float(bias[o]);
            }
            out[r * out_features + o] = float_to_bf16(value);
        }
    }
}

/* out = x . (scales * W)^T for int8 W: see int8_block. Returns FT_OUT_OF_MEMORY when out of memory. */
FtStatus ft_int8_matmul(const int8_t *weight, const uint16_t *scales, const uint16_t *bias, int64_t out_features,
                        int64_t in_features, const uint16_t *x, int64_t rows, uint16_t *out, int num_threads) {
    float *inputs = malloc((size_t)(rows * in_features) * sizeof(float));
    if (inputs == NULL) {
        return FT_OUT_OF_MEMORY;
    }
    load_row(x, 0, rows * in_features, DTYPE_BFLOAT16, inputs);
#pragma omp parallel num_threads(num_threads) if (out_features * in_features >= 4 * PARALLEL_MIN_ELEMENTS)
    {
        int64_t begin, end;
        thread_rows(out_features, &begin, &end);
#define INT8_BLOCK(n) int8_block(weight, scales, bias, out_features, in_features, inputs, n, begin, end, out)
        DISPATCH_ROWS(rows, INT8_BLOCK)
#undef INT8_BLOCK
    }
    free(inputs);
    return FT_OK;
}

/* ---- the decode step ---- */

typedef struct {
    uint16_t *residual; /* [rows, hidden] */
    uint16_t *normed;   /* [rows, max(hidden, intermediate)]: a projection's input */
    uint16_t *qkv;      /* [rows, (heads + 2 kv_heads) * head_dim] */
    uint16_t *attended; /* [rows, heads * head_dim] */
    uint16_t *gate_up;  /* [rows, 2 * intermediate] */
    uint16_t *hidden;   /* [rows, hidden]: the caller's; a layer's output */
    int failed;         /* set when a row kernel could not allocate its scratch */
} Activations;

typedef struct {
    float *sums;       /* [rows, max groups] */
    uint16_t *paired;  /* [rows, widest input] */
    float *row_scales; /* [2 * max groups] */
    float *rows;       /* [2 * hidden]: the last residual add */
    float *scores;     /* [max seq_len] */
} ThreadScratch;

static int64_t max_i64(int64_t a, int64_t b) {
    return a > b ? a : b;
}

/* Every slot, block id and length lies inside the cache: 1, else 0. */
static int batch_in_bounds(const DecodeModel *m, const DecodeBatch *b) {
    for (int64_t s = 0; s < b->num_sequences; s++) {
        if (b->slot_mapping[s] < 0 || b->slot_mapping[s] >= m->num_slots) {
            return 0;
        }
    }
    return tables_in_bounds(m->num_slots, b->block_table, b->max_blocks, b->block_size, b->seq_lens, b->num_sequences);
}

static void note_failure(Activations *a) {
#pragma omp atomic write
    a->failed = 1;
}

/* hidden -> normed (first layer: residual = hidden) or hidden + residual -> residual, normed. */
static void norm_rows(const DecodeModel *m, const uint16_t *norm_weight, int first_layer, Activations *a,
                      int64_t rows) {
    int64_t hidden = m->hidden_size;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        int succeeded;
        if (first_layer) {
            memcpy(a->residual + r * hidden, a->hidden + r * hidden, (size_t)hidden * sizeof(uint16_t));
            succeeded = rms_norm_rows(a->hidden, norm_weight, a->normed, r, r + 1, hidden, m->rms_norm_eps,
                                      DTYPE_BFLOAT16);
        } else {
            succeeded = add_rms_norm_rows(a->hidden, a->residual, norm_weight, a->normed, a->residual, r, r + 1,
                                          hidden, m->rms_norm_eps, DTYPE_BFLOAT16);
        }
        if (!succeeded) {
            note_failure(a);
        }
    }
}

/* All threads: out = x . W^T, after each prepares x for itself (no barrier). */
static void project(const Int4Weight *w, const uint16_t *x, int64_t rows, ThreadScratch *t, uint16_t *out) {
    prepare_inputs(x, rows, w->in_features, t->paired, t->sums);
    int4_share(w, t->paired, t->sums, rows, t->row_scales, out);
#pragma omp barrier
}

/* Rotary on the new queries and keys, then their K/V into the cache: one row per thread turn. */
static void rotate_and_store(const DecodeModel *m, const DecodeLayer *layer, const DecodeBatch *b, Activations *a,
                             int64_t rows) {
    int64_t head_dim = m->head_dim, kv_width = m->num_kv_heads * head_dim;
    int64_t qkv_width = (m->num_heads + 2 * m->num_kv_heads) * head_dim;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        uint16_t *qkv_row = a->qkv + r * qkv_width;
        rotary_rows(qkv_row, 0, 0, 1, m->num_heads + m->num_kv_heads, head_dim, b->cos + r * head_dim,
                    b->sin + r * head_dim, DTYPE_BFLOAT16);
        uint16_t *keys = layer->kv_cache, *values = layer->kv_cache + m->num_slots * kv_width;
        int64_t slot = b->slot_mapping[r];
        memcpy(keys + slot * kv_width, qkv_row + m->num_heads * head_dim, (size_t)kv_width * 2);
        memcpy(values + slot * kv_width, qkv_row + (m->num_heads + m->num_kv_heads) * head_dim, (size_t)kv_width * 2);
    }
}

/* One sequence's cached K and V at one KV head, read through its block table. */
typedef struct {
    const uint16_t *keys;   /* the cache's keys at this KV head: slot s at keys + s * kv_width */
    const uint16_t *values; /* likewise */
    int64_t kv_width;       /* kv_heads * head_dim */
    const int64_t *blocks;  /* the sequence's block ids */
    int64_t block_size;
    int64_t seq_len;        /* keys to attend over */
} PagedContext;

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

static void attend_paged(const uint16_t *query, const PagedContext *context, int64_t head_dim, float scale,
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
static PagedContext paged_context(const uint16_t *kv_cache, int64_t num_slots, int64_t num_heads, int64_t num_kv_heads,
                                  int64_t head_dim, const int64_t *block_table, int64_t max_blocks,
                                  int64_t block_size, const int64_t *seq_lens, int64_t sequence, int64_t head) {
    int64_t kv_width = num_kv_heads * head_dim, kv_head = head / (num_heads / num_kv_heads);
    const uint16_t *keys = kv_cache + kv_head * head_dim;
    PagedContext context = {keys, keys + num_slots * kv_width, kv_width, block_table + sequence * max_blocks,
                            block_size, seq_lens[sequence]};
    return context;
}

static void attend(const DecodeModel *m, const DecodeLayer *layer, const DecodeBatch *b, Activations *a, int64_t rows,
                   ThreadScratch *t) {
    int64_t head_dim = m->head_dim, qkv_width = (m->num_heads + 2 * m->num_kv_heads) * head_dim;
#pragma omp for schedule(static)
    for (int64_t item = 0; item < rows * m->num_heads; item++) {
        int64_t sequence = item / m->num_heads, head = item % m->num_heads;
        PagedContext context = paged_context(layer->kv_cache, m->num_slots, m->num_heads, m->num_kv_heads, head_dim,
                                             b->block_table, b->max_blocks, b->block_size, b->seq_lens, sequence, head);
        attend_paged(a->qkv + sequence * qkv_width + head * head_dim, &context, head_dim, m->attention_scale,
                     t->scores, a->attended + item * head_dim);
    }
}

static void silu_and_mul(const DecodeModel *m, Activations *a, int64_t rows) {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        if (!silu_and_mul_rows(a->gate_up, a->normed, r, r + 1, m->intermediate_size, DTYPE_BFLOAT16)) {
            note_failure(a);
        }
    }
}

static void decoder_layer(const DecodeModel *m, const DecodeLayer *layer, int first_layer, const DecodeBatch *b,
                          Activations *a, ThreadScratch *t) {
    int64_t rows = b->num_sequences;
    norm_rows(m, layer->input_norm, first_layer, a, rows);
    project(&layer->qkv, a->normed, rows, t, a->qkv);
    rotate_and_store(m, layer, b, a, rows);
    attend(m, layer, b, a, rows, t);
    project(&layer->o, a->attended, rows, t, a->hidden);
    norm_rows(m, layer->post_attention_norm, 0, a, rows);
    project(&layer->gate_up, a->normed, rows, t, a->gate_up);
    silu_and_mul(m, a, rows);
    project(&layer->down, a->normed, rows, t, a->hidden);
}

static void add_residual(const DecodeModel *m, Activations *a, int64_t rows, ThreadScratch *t) {
    int64_t hidden = m->hidden_size;
    float *row = t->rows, *residual = t->rows + hidden;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        load_row(a->hidden, r * hidden, hidden, DTYPE_BFLOAT16, row);
        load_row(a->residual, r * hidden, hidden, DTYPE_BFLOAT16, residual);
        for (int64_t c = 0; c < hidden; c++) {
            row[c] += residual[c];
        }
        store_row(row, hidden, DTYPE_BFLOAT16, a->hidden, r * hidden);
    }
}

/* The widest input a projection of the step reads. */
static int64_t widest_input(const DecodeModel *m) {
    return max_i64(max_i64(m->hidden_size, m->intermediate_size), m->num_heads * m->head_dim);
}

static int thread_scratch(const DecodeModel *m, const DecodeBatch *b, ThreadScratch *t) {
    int64_t widest = widest_input(m), max_groups = widest / INT4_GROUP;
    int64_t max_seq_len = 1;
    for (int64_t s = 0; s < b->num_sequences; s++) {
        max_seq_len = max_i64(max_seq_len, b->seq_lens[s]);
    }
    /* in floats; the paired inputs (bf16) take half a float each, rounded up */
    int64_t counts[5] = {b->num_sequences * max_groups, (b->num_sequences * widest + 1) / 2, 2 * max_groups,
                         2 * m->hidden_size, max_seq_len + 16};
    int64_t total = 0;
    for (int i = 0; i < 5; i++) {
        total += counts[i];
    }
    float *memory = malloc((size_t)total * sizeof(float));
    if (memory == NULL) {
        return 0;
    }
    void **parts[5] = {(void **)&t->sums, (void **)&t->paired, (void **)&t->row_scales, (void **)&t->rows,
                       (void **)&t->scores};
    for (int i = 0; i < 5; i++) {
        *parts[i] = memory;
        memory += counts[i];
    }
    return 1;
}

/* Every layer of `m` for one new token per sequence of `b`: `hidden` [rows, hidden_size]
 * holds the tokens' embeddings on entry and the last layer's output plus its residual on
 * return; each layer's K/V go into its cache at the batch's slots. Returns FT_OK, FT_OUT_OF_MEMORY,
 * or FT_OUT_OF_BOUNDS (touching nothing) when a slot, block id or length lies outside the cache. */
FtStatus ft_decode_step(const DecodeModel *m, const DecodeBatch *b, uint16_t *hidden, int num_threads) {
    int64_t rows = b->num_sequences;
    if (rows < 1 || rows > DECODE_MAX_ROWS || !batch_in_bounds(m, b)) {
        return FT_OUT_OF_BOUNDS;
    }
    int64_t widest = widest_input(m);
    int64_t qkv_width = (m->num_heads + 2 * m->num_kv_heads) * m->head_dim;
    int64_t widths[5] = {m->hidden_size, widest, qkv_width, m->num_heads * m->head_dim, 2 * m->intermediate_size};
    int64_t total = 0;
    for (int i = 0; i < 5; i++) {
        total += rows * widths[i];
    }
    uint16_t *memory = malloc((size_t)total * sizeof(uint16_t));
    if (memory == NULL) {
        return FT_OUT_OF_MEMORY;
    }
    Activations activations = {memory, memory + rows * widths[0], NULL, NULL, NULL, hidden, 0};
    activations.qkv = activations.normed + rows * widths[1];
    activations.attended = activations.qkv + rows * widths[2];
    activations.gate_up = activations.attended + rows * widths[3];
    int all_allocated = 1;
#pragma omp parallel num_threads(num_threads)
    {
        ThreadScratch scratch;
        int allocated = thread_scratch(m, b, &scratch);
        /* Every thread learns whether all allocated before any starts: none may skip a barrier. */
#pragma omp atomic
        all_allocated &= allocated;
#pragma omp barrier
        if (all_allocated) {
            for (int64_t l = 0; l < m->num_layers; l++) {
                decoder_layer(m, &m->layers[l], l == 0, b, &activations, &scratch);
            }
            add_residual(m, &activations, rows, &scratch);
        }
        if (allocated) {
            free(scratch.sums);
        }
    }
    free(memory);
    return all_allocated && !activations.failed ? FT_OK : FT_OUT_OF_MEMORY;
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
