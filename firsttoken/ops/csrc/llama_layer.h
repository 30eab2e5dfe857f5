/* The Llama layer, written once for every whole step (the int4 decodes of portable_decode_step.c
 * and decode_step.c, the W8A8 step of w8a8_step.c):
 *   (add +) RMSNorm -> QKV -> rotary -> KV write -> attention -> O -> add + RMSNorm
 *   -> gate/up -> SiLU * up -> down,
 * the model's output being the last layer's product plus its residual. A whole step brings the
 * kernels of each stage (its projection kind: int4, W8A8; its attention; its dtype) and the
 * state they share; llama_layers runs them in this order, layer after layer. */
#ifndef FIRSTTOKEN_LLAMA_LAYER_H
#define FIRSTTOKEN_LLAMA_LAYER_H

#include "common.h"

/* One whole step's kernels for the stages of a layer. Each takes the step's state and the layer's
 * index, and returns FT_OK or the status the step ends with. A step that runs inside one OpenMP
 * region calls them on every thread: its stages then end with the barrier their readers need and
 * never return early on one thread only (they note a failure and return FT_OK). */
typedef struct {
    /* The input norm (the first layer's residual is its input; later layers add the residual
     * first), then the QKV projection of the normed rows. */
    FtStatus (*norm_and_qkv)(void *step, int64_t layer);
    /* Rotary on the new queries and keys, then the new keys and values into the layer's cache. */
    FtStatus (*rotate_and_store)(void *step, int64_t layer);
    /* The queries over their sequences' keys, the new ones included. */
    FtStatus (*attend)(void *step, int64_t layer);
    FtStatus (*output_projection)(void *step, int64_t layer);
    /* Residual add and the post-attention norm, the gate/up projection, SiLU(gate) * up. */
    FtStatus (*norm_and_gate_up)(void *step, int64_t layer);
    FtStatus (*down_projection)(void *step, int64_t layer);
} LayerStages;

/* Layers 0 .. num_layers - 1 of a step, each stage in the layer's order; stops at the first
 * status other than FT_OK and returns it. */
FT_INTERNAL FtStatus llama_layers(const LayerStages *stages, void *step, int64_t num_layers);

#endif
