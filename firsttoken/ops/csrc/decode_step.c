/* A whole decode step of a Llama-family model with int4 weights, in one call.
 *
 * A decode step reads every weight once for a handful of tokens: its time is the weights'
 * bytes plus, in torch, about ten small ops per projection and per norm that each cost more
 * to dispatch than to compute. Here the layers run back to back inside one OpenMP region on
 * torch's own threads (projections split by output rows, attention by query heads), with
 * bf16 activations rounded exactly where the per-op path rounds them:
 *   (add +) RMSNorm -> QKV -> rotary -> KV write -> attention -> O -> add + RMSNorm
 *   -> gate/up -> SiLU * up -> down, and finally hidden + residual.
 * The projections are the int4 kernel's (quantized_matmul_bf16.c), the attention the paged
 * decode attention's (paged_decode_attention.c).
 */
#include "decode_kernels.h"

#if VECTOR_BF16
/* Int4Weight, DecodeLayer, DecodeModel and DecodeBatch, the structs Python fills, come from
 * native_abi.h. */

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
    float *scores;     /* [PAGED_HEADS_PER_PASS * (max seq_len + 16)] */
} ThreadScratch;

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
        rotary_rows(qkv_row, 0, 0, 1, m->num_heads + m->num_kv_heads, head_dim,
                    (const uint16_t *)b->cos + r * head_dim, (const uint16_t *)b->sin + r * head_dim, DTYPE_BFLOAT16);
        uint16_t *keys = layer->kv_cache;
        uint16_t *values = keys + m->num_slots * kv_width;
        int64_t slot = b->slot_mapping[r];
        memcpy(keys + slot * kv_width, qkv_row + m->num_heads * head_dim, (size_t)kv_width * 2);
        memcpy(values + slot * kv_width, qkv_row + (m->num_heads + m->num_kv_heads) * head_dim, (size_t)kv_width * 2);
    }
}

static void attend(const DecodeModel *m, const DecodeLayer *layer, const DecodeBatch *b, Activations *a, int64_t rows,
                   ThreadScratch *t) {
    int64_t head_dim = m->head_dim, qkv_width = (m->num_heads + 2 * m->num_kv_heads) * head_dim;
    int64_t heads_per_item = decode_heads_per_item(rows, m->num_heads, m->num_kv_heads, omp_get_num_threads());
    int64_t items_per_row = m->num_heads / heads_per_item;
#pragma omp for schedule(static)
    for (int64_t item = 0; item < rows * items_per_row; item++) {
        int64_t sequence = item / items_per_row, head = item % items_per_row * heads_per_item;
        PagedContext context = paged_context(layer->kv_cache, m->num_slots, m->num_heads, m->num_kv_heads, head_dim,
                                             b->block_table, b->max_blocks, b->block_size, b->seq_lens, sequence, head);
        attend_paged_heads(a->qkv + sequence * qkv_width + head * head_dim, heads_per_item, &context, head_dim,
                           m->attention_scale, t->scores, a->attended + (sequence * m->num_heads + head) * head_dim);
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

static int thread_scratch(const DecodeModel *m, const DecodeBatch *b, ThreadScratch *t) {
    int64_t widest = decode_widest_input(m), max_groups = widest / INT4_GROUP_SIZE;
    int64_t max_seq_len = 1;
    for (int64_t s = 0; s < b->num_sequences; s++) {
        max_seq_len = max_i64(max_seq_len, b->seq_lens[s]);
    }
    /* in floats; the paired inputs (bf16) take half a float each, rounded up */
    int64_t counts[5] = {b->num_sequences * max_groups, (b->num_sequences * widest + 1) / 2, 2 * max_groups,
                         2 * m->hidden_size, PAGED_HEADS_PER_PASS * (max_seq_len + 16)};
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
    if (rows < 1 || rows > DECODE_MAX_ROWS || !decode_batch_in_bounds(m, b)) {
        return FT_OUT_OF_BOUNDS;
    }
    int64_t widest = decode_widest_input(m);
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
#endif
