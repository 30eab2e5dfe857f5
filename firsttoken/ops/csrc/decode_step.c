/* A whole decode step of a Llama-family model with int4 weights and bf16 activations, in one call.
 *
 * A decode step reads every weight once for a handful of tokens: its time is the weights'
 * bytes plus, in torch, about ten small ops per projection and per norm that each cost more
 * to dispatch than to compute. Here the layers (decode_layers, portable_decode_step.c) run back
 * to back inside one OpenMP region on torch's own threads (projections split by output rows,
 * attention by query heads), with bf16 activations rounded exactly where the per-op path
 * rounds them. The projections are the int4 kernel's (quantized_matmul_bf16.c), the attention
 * the paged decode attention's (paged_decode_attention.c).
 */
#include "decode_kernels.h"

#if VECTOR_BF16
/* Int4Weight, DecodeLayer, DecodeModel and DecodeBatch, the structs Python fills, come from
 * native_abi.h. */

typedef struct {
    float *sums;       /* [rows, max groups] */
    uint16_t *paired;  /* [rows, widest input] */
    float *row_scales; /* [2 * max groups] */
    float *scores;     /* [PAGED_HEADS_PER_PASS * (max seq_len + 16)] */
} Bf16Scratch;

/* Each thread prepares x for itself. */
static void bf16_project(const Int4Weight *w, const void *x, int64_t rows, void *scratch, void *out) {
    Bf16Scratch *t = scratch;
    prepare_inputs(x, rows, w->in_features, t->paired, t->sums);
    int4_share(w, t->paired, t->sums, rows, t->row_scales, out);
}

static void bf16_attend(const DecodeModel *m, const DecodeLayer *layer, const DecodeBatch *b, const void *qkv,
                        void *attended, void *scratch) {
    int64_t rows = b->num_sequences, head_dim = m->head_dim;
    int64_t qkv_width = (m->num_heads + 2 * m->num_kv_heads) * head_dim;
    int64_t heads_per_item = decode_heads_per_item(rows, m->num_heads, m->num_kv_heads, omp_get_num_threads());
    int64_t items_per_row = m->num_heads / heads_per_item;
#pragma omp for schedule(static) nowait
    for (int64_t item = 0; item < rows * items_per_row; item++) {
        int64_t sequence = item / items_per_row, head = item % items_per_row * heads_per_item;
        PagedContext context = paged_context(layer->kv_cache, m->num_slots, m->num_heads, m->num_kv_heads, head_dim,
                                             b->block_table, b->max_blocks, b->block_size, b->seq_lens, sequence, head);
        attend_paged_heads((const uint16_t *)qkv + sequence * qkv_width + head * head_dim, heads_per_item, &context,
                           head_dim, m->attention_scale, ((Bf16Scratch *)scratch)->scores,
                           (uint16_t *)attended + (sequence * m->num_heads + head) * head_dim);
    }
}

/* The struct, then each array on cache lines of its own (the kernels' vector loads split none),
 * in one allocation freed by free. */
static void *bf16_scratch(const DecodeModel *m, const DecodeBatch *b, int num_threads) {
    int64_t widest = decode_widest_input(m), max_groups = widest / INT4_GROUP_SIZE;
    int64_t max_seq_len = 1;
    for (int64_t s = 0; s < b->num_sequences; s++) {
        max_seq_len = max_i64(max_seq_len, b->seq_lens[s]);
    }
    size_t bytes[4] = {(size_t)(b->num_sequences * max_groups) * sizeof(float),
                       (size_t)(b->num_sequences * widest) * sizeof(uint16_t), (size_t)(2 * max_groups) * sizeof(float),
                       (size_t)(PAGED_HEADS_PER_PASS * (max_seq_len + 16)) * sizeof(float)};
    size_t offsets[4], total = (sizeof(Bf16Scratch) + 63) / 64 * 64;
    for (int i = 0; i < 4; i++) {
        offsets[i] = total;
        total += (bytes[i] + 63) / 64 * 64;
    }
    Bf16Scratch *t = aligned_alloc(64, total);
    if (t == NULL) {
        return NULL;
    }
    void **parts[4] = {(void **)&t->sums, (void **)&t->paired, (void **)&t->row_scales, (void **)&t->scores};
    for (int i = 0; i < 4; i++) {
        *parts[i] = (char *)t + offsets[i];
    }
    return t;
}

static const DecodeStepKernels BF16_KERNELS = {DTYPE_BFLOAT16, bf16_scratch, free, bf16_project, bf16_attend};

/* decode_layers with bf16 activations, norms, caches, cos and sin; FT_BAD_SHAPE for a layer with a
 * sliding window (the paged kernel attends over every key). */
FtStatus ft_decode_step(const DecodeModel *m, const DecodeBatch *b, uint16_t *hidden, int num_threads) {
    for (int64_t l = 0; l < m->num_layers; l++) {
        if (m->layers[l].window != 0) {
            return FT_BAD_SHAPE;
        }
    }
    return decode_layers(&BF16_KERNELS, m, b, hidden, num_threads);
}
#endif
