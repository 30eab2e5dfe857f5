/* A whole decode step of a Llama-family model with int4 weights, in one call: the decode's
 * stages of the Llama layer (llama_layer.h) that both int4 steps run (decode_layers), and the
 * step with float32 activations, on every ISA.
 *
 * A decode step reads every weight once for a handful of tokens; in torch about fifteen ops
 * per layer each cost a dispatch and a call into the kernels (some 15 ms a step for a 30-layer
 * model on a 2-core AVX2 machine, half the int4 projections' time). Here the layers run back
 * to back inside one OpenMP region on torch's threads, on the very kernels the per-op path
 * calls, so each row gets the per-op path's bits. The norms, rotary, KV write and SwiGLU are
 * row_kernels.c's in both steps. The float32 step's projections are the portable int4 kernel's
 * (quantized_matmul.c), its attention the flash decode attention's (attention.c); the bf16
 * step's are decode_step.c's.
 */
#include "decode_kernels.h"
#include "llama_layer.h"

/* [rows, width] each, in the step's dtype. */
typedef struct {
    void *residual; /* [rows, hidden] */
    void *normed;   /* [rows, max(hidden, intermediate)]: a projection's input */
    void *qkv;      /* [rows, (heads + 2 kv_heads) * head_dim] */
    void *attended; /* [rows, heads * head_dim] */
    void *gate_up;  /* [rows, 2 * intermediate] */
    void *hidden;   /* [rows, hidden]: the caller's; a layer's output */
    int dtype;      /* DTYPE_FLOAT32 or DTYPE_BFLOAT16 */
    int failed;     /* set when a row kernel could not allocate its scratch */
} Activations;

static int decode_batch_in_bounds(const DecodeModel *m, const DecodeBatch *b) {
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

/* Element `index` of an array in the activations' dtype. */
static char *element(const Activations *a, void *array, int64_t index) {
    return (char *)array + index * element_size(a->dtype);
}

static void note_failure(Activations *a) {
#pragma omp atomic write
    a->failed = 1;
}

/* hidden -> normed (first layer: residual = hidden) or hidden + residual -> residual, normed. */
static void norm_rows(const DecodeModel *m, const void *norm_weight, int first_layer, Activations *a, int64_t rows) {
    int64_t hidden = m->hidden_size;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        int succeeded;
        if (first_layer) {
            memcpy(element(a, a->residual, r * hidden), element(a, a->hidden, r * hidden),
                   (size_t)(hidden * element_size(a->dtype)));
            succeeded = rms_norm_rows(a->hidden, norm_weight, a->normed, r, r + 1, hidden, m->rms_norm_eps, a->dtype);
        } else {
            succeeded = add_rms_norm_rows(a->hidden, a->residual, norm_weight, a->normed, a->residual, r, r + 1,
                                          hidden, m->rms_norm_eps, a->dtype);
        }
        if (!succeeded) {
            note_failure(a);
        }
    }
}

/* All threads: out = x . W^T, then a barrier (the next stage reads every thread's outputs). */
static void project(const DecodeStepKernels *k, const Int4Weight *w, const void *x, int64_t rows, void *scratch,
                    void *out) {
    k->project(w, x, rows, scratch, out);
#pragma omp barrier
}

/* Rotary on the new queries and keys, then their K/V into the cache: one row per thread turn. */
static void rotate_and_store(const DecodeModel *m, const DecodeLayer *layer, const DecodeBatch *b, Activations *a,
                             int64_t rows) {
    int64_t head_dim = m->head_dim, q_width = m->num_heads * head_dim, kv_width = m->num_kv_heads * head_dim;
    int64_t qkv_width = q_width + 2 * kv_width;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        if (!rotary_rows(a->qkv, qkv_width, r, r + 1, m->num_heads + m->num_kv_heads, head_dim, b->cos, b->sin,
                         a->dtype)) {
            note_failure(a);
        }
        int64_t slot = b->slot_mapping[r];
        size_t bytes = (size_t)(kv_width * element_size(a->dtype));
        memcpy(element(a, layer->kv_cache, slot * kv_width), element(a, a->qkv, r * qkv_width + q_width), bytes);
        memcpy(element(a, layer->kv_cache, (m->num_slots + slot) * kv_width),
               element(a, a->qkv, r * qkv_width + q_width + kv_width), bytes);
    }
}

static void silu_and_mul(const DecodeModel *m, Activations *a, int64_t rows) {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        if (!silu_and_mul_rows(a->gate_up, a->normed, r, r + 1, m->intermediate_size, a->dtype)) {
            note_failure(a);
        }
    }
}

/* One thread's view of the step: what every stage reads (llama_layer.h). */
typedef struct {
    const DecodeStepKernels *kernels;
    const DecodeModel *model;
    const DecodeBatch *batch;
    Activations *activations;
    void *scratch; /* this thread's */
} DecodeStep;

static FtStatus norm_and_qkv(void *step, int64_t layer) {
    DecodeStep *s = step;
    int64_t rows = s->batch->num_sequences;
    norm_rows(s->model, s->model->layers[layer].input_norm, layer == 0, s->activations, rows);
    project(s->kernels, &s->model->layers[layer].qkv, s->activations->normed, rows, s->scratch, s->activations->qkv);
    return FT_OK;
}

static FtStatus rotate_and_store_stage(void *step, int64_t layer) {
    DecodeStep *s = step;
    rotate_and_store(s->model, &s->model->layers[layer], s->batch, s->activations, s->batch->num_sequences);
    return FT_OK;
}

static FtStatus attend(void *step, int64_t layer) {
    DecodeStep *s = step;
    s->kernels->attend(s->model, &s->model->layers[layer], s->batch, s->activations->qkv, s->activations->attended,
                       s->scratch);
#pragma omp barrier
    return FT_OK;
}

static FtStatus output_projection(void *step, int64_t layer) {
    DecodeStep *s = step;
    project(s->kernels, &s->model->layers[layer].o, s->activations->attended, s->batch->num_sequences, s->scratch,
            s->activations->hidden);
    return FT_OK;
}

static FtStatus norm_and_gate_up(void *step, int64_t layer) {
    DecodeStep *s = step;
    int64_t rows = s->batch->num_sequences;
    norm_rows(s->model, s->model->layers[layer].post_attention_norm, 0, s->activations, rows);
    project(s->kernels, &s->model->layers[layer].gate_up, s->activations->normed, rows, s->scratch,
            s->activations->gate_up);
    silu_and_mul(s->model, s->activations, rows);
    return FT_OK;
}

static FtStatus down_projection(void *step, int64_t layer) {
    DecodeStep *s = step;
    project(s->kernels, &s->model->layers[layer].down, s->activations->normed, s->batch->num_sequences, s->scratch,
            s->activations->hidden);
    return FT_OK;
}

/* Every stage runs on every thread and notes, never returns, a failure: no thread may skip a
 * barrier the others wait at. */
static const LayerStages DECODE_STAGES = {norm_and_qkv,      rotate_and_store_stage, attend,
                                          output_projection, norm_and_gate_up,       down_projection};

/* hidden += residual, rounded to the dtype once as the per-op path's add rounds it. */
static void add_residual(const DecodeModel *m, Activations *a, int64_t rows) {
    int64_t hidden = m->hidden_size;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        float *sums = malloc((size_t)(2 * hidden) * sizeof(float));
        if (sums == NULL) {
            note_failure(a);
            continue;
        }
        add_residual_row(a->hidden, a->residual, r, hidden, a->dtype, sums, sums + hidden, a->hidden);
        free(sums);
    }
}

FT_INTERNAL FtStatus decode_layers(const DecodeStepKernels *kernels, const DecodeModel *m, const DecodeBatch *b,
                                   void *hidden, int num_threads) {
    int64_t rows = b->num_sequences;
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
    Activations activations = {NULL, NULL, NULL, NULL, NULL, hidden, kernels->dtype, 0};
    char *memory = malloc((size_t)(total * element_size(kernels->dtype)));
    if (memory == NULL) {
        return FT_OUT_OF_MEMORY;
    }
    void **parts[5] = {&activations.residual, &activations.normed, &activations.qkv, &activations.attended,
                       &activations.gate_up};
    int64_t offset = 0;
    for (int i = 0; i < 5; i++) {
        *parts[i] = element(&activations, memory, offset);
        offset += rows * widths[i];
    }
    int all_allocated = 1;
#pragma omp parallel num_threads(num_threads)
    {
        void *scratch = kernels->thread_scratch(m, b, num_threads);
        /* Every thread learns whether all allocated before any starts: none may skip a barrier. */
#pragma omp atomic
        all_allocated &= scratch != NULL;
#pragma omp barrier
        if (all_allocated) {
            DecodeStep step = {kernels, m, b, &activations, scratch};
            llama_layers(&DECODE_STAGES, &step, m->num_layers);
            add_residual(m, &activations, rows);
        }
        kernels->free_scratch(scratch);
    }
    free(memory);
    return all_allocated && !activations.failed ? FT_OK : FT_OUT_OF_MEMORY;
}

typedef struct {
    float *input_sums; /* [rows, widest input / INT4_GROUP_SIZE] */
    void *attention;   /* decode_attention_scratch */
    int64_t heads_per_item;
} Float32Scratch;

/* Each thread sums x's groups for itself. */
static void float32_project(const Int4Weight *w, const void *x, int64_t rows, void *scratch, void *out) {
    Float32Scratch *t = scratch;
    portable_int4_input_sums(x, rows, w->in_features, t->input_sums);
    portable_int4_share(w, x, t->input_sums, rows, DTYPE_FLOAT32, out);
}

static void float32_attend(const DecodeModel *m, const DecodeLayer *layer, const DecodeBatch *b, const void *qkv,
                           void *attended, void *scratch) {
    Float32Scratch *t = scratch;
    int64_t qkv_width = (m->num_heads + 2 * m->num_kv_heads) * m->head_dim;
    DecodeAttention attention = {qkv,           qkv_width,      layer->kv_cache, m->num_slots,      b->block_table,
                                 b->max_blocks, b->seq_lens,    b->block_size,   b->num_sequences,  m->num_heads,
                                 m->num_kv_heads, m->head_dim,  m->attention_scale, attended,       DTYPE_FLOAT32,
                                 layer->window, 0.0f, 0, NULL /* Llama's layers: no soft-cap, no sinks */};
    decode_attention_share(&attention, t->heads_per_item, t->attention);
}

static void free_float32_scratch(void *scratch) {
    Float32Scratch *t = scratch;
    if (t != NULL) {
        free(t->input_sums);
        free_decode_attention_scratch(t->attention);
        free(t);
    }
}

static void *float32_scratch(const DecodeModel *m, const DecodeBatch *b, int num_threads) {
    Float32Scratch *t = malloc(sizeof(Float32Scratch));
    if (t == NULL) {
        return NULL;
    }
    int64_t rows = b->num_sequences;
    t->heads_per_item = decode_heads_per_item(rows, m->num_heads, m->num_kv_heads, num_threads);
    t->input_sums = malloc((size_t)(rows * (decode_widest_input(m) / INT4_GROUP_SIZE)) * sizeof(float));
    t->attention = decode_attention_scratch(t->heads_per_item, m->head_dim);
    if (t->input_sums == NULL || t->attention == NULL) {
        free_float32_scratch(t);
        return NULL;
    }
    return t;
}

static const DecodeStepKernels FLOAT32_KERNELS = {DTYPE_FLOAT32, float32_scratch, free_float32_scratch,
                                                  float32_project, float32_attend};

/* decode_layers with float32 activations, norms, caches, cos and sin (int4 projections with
 * float32 biases), each layer within its sliding window where it has one; FT_BAD_SHAPE for a head
 * shape the attention does not take. */
FtStatus ft_portable_decode_step(const DecodeModel *m, const DecodeBatch *b, float *hidden, int num_threads) {
    if (!decode_attention_supported(m->num_heads, m->num_kv_heads, m->head_dim)) {
        return FT_BAD_SHAPE;
    }
    for (int64_t l = 0; l < m->num_layers; l++) {
        if (m->layers[l].window < 0) {
            return FT_BAD_SHAPE;
        }
    }
    return decode_layers(&FLOAT32_KERNELS, m, b, hidden, num_threads);
}
