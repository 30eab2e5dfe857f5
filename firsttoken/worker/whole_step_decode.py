"""The native whole-step decode: every layer of a decode-only step in one native call
(ops/native_decode.py), for a model whose projections are all int4 on the native kernels:
bf16 on AVX512-BF16 builds, float32 on every build.

The runner takes it for the steps it serves and runs the model's forward for every other one;
the model itself knows nothing of it.
"""

from __future__ import annotations

import torch
from torch import nn

from firsttoken.attention.backend import BatchLayout, decode_tables
from firsttoken.models.llama import LlamaForCausalLM
from firsttoken.ops import native_abi
from firsttoken.ops.linear_choice import DecodeQuantizedLinear
from firsttoken.ops.native_decode import (
    STEP_PROJECTIONS,
    DecodeLayerWeights,
    NativeDecodeStep,
    supports_layers,
)
from firsttoken.worker.whole_step_layers import layer_shape, whole_step_unsupported_reason


class WholeStepDecode:
    """Owns the native step over a model's weights and KV caches; reads the model's embedding
    and rotary table for the step's inputs."""

    def __init__(self, model: LlamaForCausalLM, native_step: NativeDecodeStep) -> None:
        self.model = model
        self.native_step = native_step

    @staticmethod
    def takes(layout: BatchLayout) -> bool:
        """Whether the step is one it serves: decodes only, at most `DECODE_MAX_ROWS` of them."""
        return 0 < layout.num_decodes == len(layout.sequences) <= native_abi.DECODE_MAX_ROWS

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        layout: BatchLayout,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] of the step before the final norm, as the model's forward gives."""
        hidden = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary_embedding(positions, hidden.dtype)
        tables = decode_tables(layout.sequences, layout.block_size, slot_mapping)
        return self.native_step.run(hidden, cos, sin, tables)


def build_whole_step_decode(model: LlamaForCausalLM) -> WholeStepDecode | None:
    """The whole-step decode of a model with its KV caches bound, for a model a whole step can
    run (`whole_step_unsupported_reason`) whose every projection's decode form is the int4 kind of
    the model's dtype's step (`native_decode.STEP_PROJECTIONS`); None elsewhere."""
    native_kernels = model.kernels.native
    if whole_step_unsupported_reason(model) is not None or model.embed_weight.dtype not in STEP_PROJECTIONS:
        return None
    layers = []
    for layer in model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        projections = [
            _decode_form(module)
            for module in (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj)
        ]
        layers.append(
            DecodeLayerWeights(
                layer.input_norm_weight,
                layer.post_attention_norm_weight,
                *projections,
                attention.kv_cache,
                attention.layer_attention.sliding_window or 0,
            )
        )
    shape = layer_shape(model.arch)
    if not supports_layers(native_kernels, shape, layers):
        return None
    return WholeStepDecode(model, NativeDecodeStep(native_kernels, shape, layers))


def _decode_form(projection: nn.Module) -> nn.Module:
    """The module that serves a projection's decode-sized steps."""
    return projection.quantized if isinstance(projection, DecodeQuantizedLinear) else projection
