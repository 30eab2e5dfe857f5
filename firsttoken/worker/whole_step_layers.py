"""Which models the whole-step native forwards can run at all, decided once for all of them.

Every whole step (the int4 decode, the W8A8 forward) runs Llama's layer on the native kernels, on
one rank, without attention sinks. A model outside that gets the per-op forward for every step;
its weights' form (int4, W8A8, dtype) and its sliding windows (the float32 int4 decode alone
attends within them) are each whole step's own question after this one.
"""

from __future__ import annotations

from firsttoken.models.arch import ModelArch
from firsttoken.models.llama import LlamaForCausalLM
from firsttoken.ops.native_step_inputs import LayerShape


def whole_step_unsupported_reason(model: LlamaForCausalLM) -> str | None:
    """Why no whole-step native forward can run this model; None where one may."""
    if model.kernels.native is None:
        return "it does not run on a CPU with native kernels"
    if not model.arch.plain_llama_layers:
        return "its layers are not Llama's (per-head query/key norms, Gemma's norms or soft-caps)"
    if model.kv_sink_tokens:
        return "its layers keep attention sinks (StreamingLLM)"
    if model.collectives is not None:
        # Row-parallel projections sum over the ranks between layers.
        return "it is sharded over tensor-parallel ranks"
    return None


def layer_shape(arch: ModelArch) -> LayerShape:
    """The dimensions a whole-step native call reads from the model's architecture."""
    return LayerShape(
        arch.hidden_size,
        arch.num_heads,
        arch.num_kv_heads,
        arch.head_dim,
        arch.intermediate_size,
        arch.rms_norm_eps,
    )
