/* A W8A8 model's step in one call: every layer's projections (ft_w8a8_norm_matmul,
 * ft_w8a8_quantize_matmul), rotary (ft_rotary), KV write (ft_write_kv) and attention (decode rows:
 * ft_paged_decode_attention or ft_decode_attention_as_prefill; prefill chunks:
 * ft_prefill_attention) back to back, as the model's forward calls them one by one from Python:
 * the W8A8 kernels of the Llama layer's stages (llama_layer.h), its norms fused into the
 * projections that read them and SiLU * up into gate/up's.
 *
 * A 512-token prefill of SmolLM2 makes some 210 kernel calls; between two of them the
 * interpreter's work (modules, views, output tensors, ctypes) runs slow, the kernel having
 * evicted its data from the caches. Here the same functions run in the same order on the same
 * rows, so the bits are the per-call path's.
 */
#include "llama_layer.h"

#if VECTOR_BF16
/* The step's intermediate rows, bf16, in one allocation. */
typedef struct {
    uint16_t *qkv; /* [T, q + 2 kv] */
    uint16_t *attended; /* [T, q] */
    uint16_t *attention_out; /* [T, hidden]: o_proj's product */
    uint16_t *attention_sum; /* [T, hidden]: the residual after the attention's add */
    uint16_t *activations; /* [T, intermediate]: SwiGLU's product */
    uint16_t *gathered; /* K then V of the longest scattered chunk's keys */
    void *allocation;
} StepRows;

/* The most keys a prefill chunk whose blocks are not consecutive attends over (0: none). */
static int64_t most_gathered_keys(const W8A8StepBatch *batch) {
    int64_t most = 0;
    for (int64_t p = 0; p < batch->num_prefills; p++) {
        int64_t keys = batch->prefills[3 * p + 1] + batch->prefills[3 * p + 2];
        if (batch->prefills[3 * p + 2] > 0 && batch->first_slots[p] < 0 && keys > most) {
            most = keys;
        }
    }
    return most;
}

static int allocate_rows(const W8A8StepModel *model, const W8A8StepBatch *batch, StepRows *rows) {
    int64_t q = model->num_heads * model->head_dim, kv = model->num_kv_heads * model->head_dim;
    int64_t tokens = batch->num_tokens;
    int64_t elements[] = {tokens * (q + 2 * kv), tokens * q, tokens * model->hidden_size,
                          tokens * model->hidden_size, tokens * model->intermediate_size,
                          2 * most_gathered_keys(batch) * kv};
    uint16_t **parts[] = {&rows->qkv, &rows->attended, &rows->attention_out, &rows->attention_sum,
                          &rows->activations, &rows->gathered};
    size_t offsets[6], total = 0;
    for (int i = 0; i < 6; i++) {
        offsets[i] = total;
        total += ((size_t)elements[i] * sizeof(uint16_t) + 63) / 64 * 64;
    }
    rows->allocation = aligned_alloc(64, total > 0 ? total : 64);
    if (rows->allocation == NULL) {
        return 0;
    }
    for (int i = 0; i < 6; i++) {
        *parts[i] = (uint16_t *)((char *)rows->allocation + offsets[i]);
    }
    return 1;
}

/* K then V of a chunk's first num_keys keys into `gathered` [2, num_keys, kv], block by block
 * through its block ids, as the per-op path gathers them (and with the same bits). */
static FtStatus gather_keys(const W8A8StepModel *model, const W8A8StepBatch *batch, const uint16_t *kv_cache,
                            int64_t chunk, int64_t num_keys, uint16_t *gathered) {
    int64_t kv = model->num_kv_heads * model->head_dim, block_size = batch->block_size;
    const int64_t *blocks = batch->prefill_blocks + chunk * batch->max_prefill_blocks;
    for (int64_t first = 0; first < num_keys; first += block_size) {
        int64_t slot = blocks[first / block_size] * block_size, count = num_keys - first;
        count = count < block_size ? count : block_size;
        if (slot < 0 || slot + count > model->num_slots) {
            return FT_OUT_OF_BOUNDS;
        }
        for (int half = 0; half < 2; half++) {
            memcpy(gathered + (half * num_keys + first) * kv, kv_cache + (half * model->num_slots + slot) * kv,
                   (size_t)(count * kv) * sizeof(uint16_t));
        }
    }
    return FT_OK;
}

/* The decode rows' attention over their blocks' keys, then each prefill chunk's causal attention
 * over its keys: the fresh ones in the qkv rows, or, after context, the cache's (written there just
 * before): in place where its blocks are consecutive slots, else gathered from its blocks. */
static FtStatus attend(const W8A8StepModel *model, const W8A8StepBatch *batch, const void *kv_cache,
                       const StepRows *rows, int num_threads) {
    int64_t head_dim = model->head_dim, q = model->num_heads * head_dim, kv = model->num_kv_heads * head_dim;
    int64_t qkv_stride = q + 2 * kv, values_offset = model->num_slots * kv;
    if (batch->num_decodes > 0) {
        FtStatus status =
            model->decode_as_prefill
                ? ft_decode_attention_as_prefill(rows->qkv, qkv_stride, kv_cache, model->num_slots, batch->block_table,
                                                 batch->max_blocks, batch->seq_lens, batch->block_size,
                                                 batch->num_decodes, model->num_heads, model->num_kv_heads, head_dim,
                                                 model->attention_scale, rows->attended, num_threads, 0, 0.0f,
                                                 model->attention_amx)
                : ft_paged_decode_attention(rows->qkv, qkv_stride, kv_cache, model->num_slots, batch->block_table,
                                            batch->max_blocks, batch->seq_lens, batch->block_size, batch->num_decodes,
                                            model->num_heads, model->num_kv_heads, head_dim, model->attention_scale,
                                            rows->attended, num_threads);
        if (status != FT_OK) {
            return status;
        }
    }
    for (int64_t p = 0; p < batch->num_prefills; p++) {
        int64_t first_row = batch->prefills[3 * p], num_queries = batch->prefills[3 * p + 1];
        int64_t context = batch->prefills[3 * p + 2];
        const uint16_t *query = rows->qkv + first_row * qkv_stride;
        const uint16_t *key = query + q, *value = query + q + kv;
        int64_t key_stride = qkv_stride;
        if (context > 0 && batch->first_slots[p] >= 0) {
            if (batch->first_slots[p] + context + num_queries > model->num_slots) {
                return FT_OUT_OF_BOUNDS;
            }
            const uint16_t *cache = kv_cache;
            key = cache + batch->first_slots[p] * kv;
            value = cache + values_offset + batch->first_slots[p] * kv;
            key_stride = kv;
        } else if (context > 0) {
            FtStatus status = gather_keys(model, batch, kv_cache, p, context + num_queries, rows->gathered);
            if (status != FT_OK) {
                return status;
            }
            key = rows->gathered;
            value = rows->gathered + (context + num_queries) * kv;
            key_stride = kv;
        }
        FtStatus status = ft_prefill_attention(query, qkv_stride, key, key_stride, value, key_stride, num_queries,
                                               context + num_queries, model->num_heads, model->num_kv_heads,
                                               head_dim, model->attention_scale, 0, 0.0f,
                                               rows->attended + first_row * q, num_threads, model->attention_amx);
        if (status != FT_OK) {
            return status;
        }
    }
    return FT_OK;
}

/* The step's state its stages (llama_layer.h) share: hidden [T, hidden] holds the embeddings, then
 * each layer's MLP product; residual [T, hidden] the residual after each layer's MLP add (read
 * by the next layer's first norm: the first layer has none). */
typedef struct {
    const W8A8StepModel *model;
    const W8A8StepBatch *batch;
    uint16_t *hidden;
    uint16_t *residual;
    const StepRows *rows;
    int num_threads;
} W8A8Step;

/* out [T, w->out_features] = quantized x . W^T, x [T, w->in_features] (SiLU(gate) * up when
 * `silu_gated`), after the norm of x (+ residual, the sum into `summed`) where `norm` is set. */
static FtStatus project(const W8A8Step *s, const W8A8Weight *w, const uint16_t *x, const uint16_t *residual,
                        const uint16_t *norm, uint16_t *summed, uint16_t *out, int silu_gated) {
    const W8A8StepModel *m = s->model;
    int64_t tokens = s->batch->num_tokens;
    if (norm == NULL) {
        return ft_w8a8_quantize_matmul(x, 0, w->column_scales, w->hadamard_block, w->hadamard_norm, w->packed,
                                       w->weight_scales, w->bias, out, tokens, w->out_features, w->in_features,
                                       DTYPE_BFLOAT16, s->num_threads, m->matmul_amx, silu_gated);
    }
    return ft_w8a8_norm_matmul(x, residual, norm, summed, m->rms_norm_eps, w->column_scales, w->hadamard_block,
                               w->hadamard_norm, w->packed, w->weight_scales, w->bias, out, tokens, w->out_features,
                               w->in_features, DTYPE_BFLOAT16, s->num_threads, m->matmul_amx, silu_gated);
}

/* Without a residual (the first layer) the norm's input is the residual after it, and the
 * attention's sum is left untouched. */
static FtStatus norm_and_qkv(void *step, int64_t layer) {
    W8A8Step *s = step;
    const W8A8StepLayer *l = &s->model->layers[layer];
    return project(s, &l->qkv, s->hidden, layer > 0 ? s->residual : NULL, l->input_norm, s->rows->attention_sum,
                   s->rows->qkv, 0);
}

static FtStatus rotate_and_store(void *step, int64_t layer) {
    W8A8Step *s = step;
    const W8A8StepModel *m = s->model;
    int64_t tokens = s->batch->num_tokens, head_dim = m->head_dim;
    int64_t q = m->num_heads * head_dim, kv = m->num_kv_heads * head_dim, qkv_stride = q + 2 * kv;
    FtStatus status = ft_rotary(s->rows->qkv, qkv_stride, tokens, m->num_heads + m->num_kv_heads, head_dim,
                                s->batch->cos, s->batch->sin, DTYPE_BFLOAT16, s->num_threads);
    if (status != FT_OK) {
        return status;
    }
    return ft_write_kv(m->layers[layer].kv_cache, m->num_slots * kv, m->num_slots, s->rows->qkv + q, qkv_stride,
                       s->rows->qkv + q + kv, qkv_stride, s->batch->slot_mapping, tokens, kv, DTYPE_BFLOAT16,
                       s->num_threads);
}

static FtStatus attend_stage(void *step, int64_t layer) {
    W8A8Step *s = step;
    return attend(s->model, s->batch, s->model->layers[layer].kv_cache, s->rows, s->num_threads);
}

static FtStatus output_projection(void *step, int64_t layer) {
    W8A8Step *s = step;
    return project(s, &s->model->layers[layer].o, s->rows->attended, NULL, NULL, NULL, s->rows->attention_out, 0);
}

static FtStatus norm_and_gate_up(void *step, int64_t layer) {
    W8A8Step *s = step;
    const W8A8StepLayer *l = &s->model->layers[layer];
    const uint16_t *attention_residual = layer > 0 ? s->rows->attention_sum : s->hidden;
    return project(s, &l->gate_up, s->rows->attention_out, attention_residual, l->post_attention_norm, s->residual,
                   s->rows->activations, 1);
}

static FtStatus down_projection(void *step, int64_t layer) {
    W8A8Step *s = step;
    return project(s, &s->model->layers[layer].down, s->rows->activations, NULL, NULL, NULL, s->hidden, 0);
}

static const LayerStages W8A8_STAGES = {norm_and_qkv,      rotate_and_store, attend_stage,
                                        output_projection, norm_and_gate_up, down_projection};

/* hidden [T, hidden] bf16: the step's embeddings in, the last layer's MLP product out; residual
 * [T, hidden] bf16 out: the residual after its add (the model's output is their sum). */
FtStatus ft_w8a8_step(const W8A8StepModel *model, const W8A8StepBatch *batch, uint16_t *hidden,
                      uint16_t *residual, int num_threads) {
    StepRows rows;
    if (!allocate_rows(model, batch, &rows)) {
        return FT_OUT_OF_MEMORY;
    }
    W8A8Step step = {model, batch, hidden, residual, &rows, num_threads};
    FtStatus status = llama_layers(&W8A8_STAGES, &step, model->num_layers);
    free(rows.allocation);
    return status;
}
#endif
