/* llama_layers: the order of a Llama layer's stages (llama_layer.h), one definition for every
 * whole step. */
#include "llama_layer.h"

FT_INTERNAL FtStatus llama_layers(const LayerStages *stages, void *step, int64_t num_layers) {
    FtStatus (*const order[])(void *, int64_t) = {stages->norm_and_qkv,      stages->rotate_and_store,
                                                  stages->attend,            stages->output_projection,
                                                  stages->norm_and_gate_up,  stages->down_projection};
    for (int64_t layer = 0; layer < num_layers; layer++) {
        for (size_t stage = 0; stage < sizeof(order) / sizeof(order[0]); stage++) {
            FtStatus status = order[stage](step, layer);
            if (status != FT_OK) {
                return status;
            }
        }
    }
    return FT_OK;
}
