/* A whole decode step of a Llama-family model with int4 weights and float32 activations, in
 * one call, on every ISA.
 *
 * A decode step reads every weight once for a handful of tokens; in torch about fifteen ops
 * per layer each cost a dispatch and a call into the kernels (some 15 ms a step for a 30-layer
 * model on a 2-core AVX2 machine, half the int4 projections' time). Here the layers run back
 * to back inside one OpenMP region on torch's threads, on the very kernels the per-op path
 * calls, so each row gets the per-op path's bits:
 *   (add +) RMSNorm -> QKV -> rotary -> KV write -> attention -> O -> add + RMSNorm
 *   -> gate/up -> SiLU * up -> down, and finally hidden + residual.
 * The projections are the portable int4 kernel's (quantized_matmul.c), the attention the flash
 * decode attention's (attention.c), the norms, rotary and SwiGLU row_kernels.c's.
 */
#include "decode_kernels.h"

typedef struct {
    float *residual; /* [rows, hidden] */
    float *normed;   /* [rows, max(hidden, intermediate)]: a projection's input */
    float *qkv;      /* [rows, (heads + 2 kv_heads) * head_dim] */
    float *attended; /* [rows, heads * head_dim] */
    float *gate_up;  /* [rows, 2 * intermediate] */
    float *hidden;   /* [rows, hidden]: the caller's; a layer's output */
    int failed;      /* set when a row kernel could not allocate its scratch */
} Activations;

typedef struct {
    float *input_sums; /* [rows, widest input / INT4_GROUP_SIZE] */
    void *attention;   /* decode_attention_scratch */
    int64_t heads_per_item;
} ThreadScratch;

FT_INTERNAL int decode_batch_in_bounds(const DecodeModel *m, const DecodeBatch *b) {
    for (int64_t s = 0; s < b->num_sequences; s++) {
        if (b->slot_mapping[s] < 0 || b->slot_mapping[s] >= m->num_slots) {
            return 0;
        }
    }
    return tables_in_bounds(m->num_slots, b->block_table, b->max_blocks, b->block_size, b->seq_lens, b->num_sequences);
}

FT_INTERNAL int64_t decode_widest_input(const DecodeModel *m) {
    return max_i64(max_i64(m->hidden_size, m->intermediate_size), m->num_heads * m->head_dim);
}

static void note_failure(Activations *a) {
#pragma omp atomic write
    a->failed = 1;
}

/* hidden -> normed (first layer: residual = hidden) or hidden + residual -> residual, normed. */
static void norm_rows(const DecodeModel *m, const float *norm_weight, int first_layer, Activations *a, int64_t rows) {
    int64_t hidden = m->hidden_size;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        int succeeded;
        if (first_layer) {
            memcpy(a->residual + r * hidden, a->hidden + r * hidden, (size_t)hidden * sizeof(float));
            succeeded = rms_norm_rows(a->hidden, norm_weight, a->normed, r, r + 1, hidden, m->rms_norm_eps,
                                      DTYPE_FLOAT32);
        } else {
            succeeded = add_rms_norm_rows(a->hidden, a->residual, norm_weight, a->normed, a->residual, r, r + 1,
                                          hidden, m->rms_norm_eps, DTYPE_FLOAT32);
        }
        if (!succeeded) {
            note_failure(a);
        }
    }
}

/* All threads: out = x . W^T, after each sums x's groups for itself (no barrier). */
static void project(const Int4Weight *w, const float *x, int64_t rows, ThreadScratch *t, float *out) {
    portable_int4_input_sums(x, rows, w->in_features, t->input_sums);
    portable_int4_share(w, x, t->input_sums, rows, DTYPE_FLOAT32, out);
#pragma omp barrier
}

/* Rotary on the new queries and keys, then their K/V into the cache. */
static void rotate_and_store(const DecodeModel *m, const DecodeLayer *layer, const DecodeBatch *b, Activations *a,
                             int64_t rows) {
    int64_t head_dim = m->head_dim, kv_width = m->num_kv_heads * head_dim;
    int64_t qkv_width = (m->num_heads + 2 * m->num_kv_heads) * head_dim;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        float *qkv_row = a->qkv + r * qkv_width;
        rotary_rows(qkv_row, 0, 0, 1, m->num_heads + m->num_kv_heads, head_dim, (const float *)b->cos + r * head_dim,
                    (const float *)b->sin + r * head_dim, DTYPE_FLOAT32);
        float *keys = layer->kv_cache;
        float *values = keys + m->num_slots * kv_width;
        int64_t slot = b->slot_mapping[r];
        memcpy(keys + slot * kv_width, qkv_row + m->num_heads * head_dim, (size_t)kv_width * sizeof(float));
        memcpy(values + slot * kv_width, qkv_row + (m->num_heads + m->num_kv_heads) * head_dim,
               (size_t)kv_width * sizeof(float));
    }
}

static void attend(const DecodeModel *m, const DecodeLayer *layer, const DecodeBatch *b, Activations *a, int64_t rows,
                   ThreadScratch *t) {
    int64_t qkv_width = (m->num_heads + 2 * m->num_kv_heads) * m->head_dim;
    DecodeAttention attention = {a->qkv,        qkv_width,      layer->kv_cache, m->num_slots,      b->block_table,
                                 b->max_blocks, b->seq_lens,    b->block_size,   rows,              m->num_heads,
                                 m->num_kv_heads, m->head_dim,  m->attention_scale, a->attended,    DTYPE_FLOAT32,
                                 0, 0.0f, 0, NULL /* whole-step decode: Llama's layers, no window */};
    decode_attention_share(&attention, t->heads_per_item, t->attention);
#pragma omp barrier
}

static void silu_and_mul(const DecodeModel *m, Activations *a, int64_t rows) {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        if (!silu_and_mul_rows(a->gate_up, a->normed, r, r + 1, m->intermediate_size, DTYPE_FLOAT32)) {
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

static void add_residual(const DecodeModel *m, Activations *a, int64_t rows) {
    int64_t hidden = m->hidden_size;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t c = 0; c < hidden; c++) {
            a->hidden[r * hidden + c] += a->residual[r * hidden + c];
        }
    }
}

static int thread_scratch(const DecodeModel *m, int64_t rows, int num_threads, ThreadScratch *t) {
    t->heads_per_item = decode_heads_per_item(rows, m->num_heads, m->num_kv_heads, num_threads);
    t->input_sums = malloc((size_t)(rows * (decode_widest_input(m) / INT4_GROUP_SIZE)) * sizeof(float));
    t->attention = decode_attention_scratch(t->heads_per_item, m->head_dim);
    return t->input_sums != NULL && t->attention != NULL;
}

static void free_thread_scratch(ThreadScratch *t) {
    free(t->input_sums);
    free_decode_attention_scratch(t->attention);
}

/* Every layer of `m` (float32 norms, caches, cos and sin; int4 projections with float32 biases)
 * for one new token per sequence of `b`: `hidden` [rows, hidden_size] float32 holds the tokens'
 * embeddings on entry and the last layer's output plus its residual on return; each layer's K/V
 * go into its cache at the batch's slots. Returns FT_OK, FT_OUT_OF_MEMORY, FT_BAD_SHAPE for a
 * head shape the attention does not take, or FT_OUT_OF_BOUNDS (touching nothing) when a slot,
 * block id or length lies outside the cache or there are more than DECODE_MAX_ROWS sequences. */
FtStatus ft_portable_decode_step(const DecodeModel *m, const DecodeBatch *b, float *hidden, int num_threads) {
    int64_t rows = b->num_sequences;
    if (!decode_attention_supported(m->num_heads, m->num_kv_heads, m->head_dim)) {
        return FT_BAD_SHAPE;
    }
    if (rows < 1 || rows > DECODE_MAX_ROWS || !decode_batch_in_bounds(m, b)) {
        return FT_OUT_OF_BOUNDS;
    }
    int64_t qkv_width = (m->num_heads + 2 * m->num_kv_heads) * m->head_dim;
    int64_t widths[5] = {m->hidden_size, decode_widest_input(m), qkv_width, m->num_heads * m->head_dim,
                         2 * m->intermediate_size};
    int64_t total = 0;
    for (int i = 0; i < 5; i++) {
        total += rows * widths[i];
    }
    float *memory = malloc((size_t)total * sizeof(float));
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
        int allocated = thread_scratch(m, rows, num_threads, &scratch);
        /* Every thread learns whether all allocated before any starts: none may skip a barrier. */
#pragma omp atomic
        all_allocated &= allocated;
#pragma omp barrier
        if (all_allocated) {
            for (int64_t l = 0; l < m->num_layers; l++) {
                decoder_layer(m, &m->layers[l], l == 0, b, &activations, &scratch);
            }
            add_residual(m, &activations, rows);
        }
        free_thread_scratch(&scratch);
    }
    free(memory);
    return all_allocated && !activations.failed ? FT_OK : FT_OUT_OF_MEMORY;
}
