"""A whole int4 decode step of a Llama-family model in one native call.

Decode on a CPU is bound by reading the weights and, in torch, by dispatch: some 15 small
ops per layer, each a few tens of microseconds of Python, torch and ctypes, together more
than the layer's int4 matmuls take. Here every layer (norms, int4 projections, rotary, the KV
write, attention over the paged cache, SwiGLU) runs in one call on torch's OpenMP threads:
in bf16 on AVX512-BF16 builds (csrc/decode_step.c, projections all `NativeInt4Linear`,
rounding its bf16 activations where the per-op path does), and in float32 on every build
(csrc/portable_decode_step.c, projections all `PortableInt4Linear`, on the per-op path's own
kernels: the same bits). It serves steps of only decodes, at most
`native_abi.DECODE_MAX_ROWS` of them; every other step takes the per-op path.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from firsttoken.ops import native, native_abi
from firsttoken.ops.native_step_inputs import DecodeTables, LayerShape
from firsttoken.ops.quantized_linear import NativeInt4Linear, PortableInt4Linear


# The int4 projection each dtype's step runs on.
STEP_PROJECTIONS: dict[torch.dtype, type] = {
    torch.bfloat16: NativeInt4Linear,
    torch.float32: PortableInt4Linear,
}


@dataclass
class DecodeLayerWeights:
    """One decoder layer as the native step reads it: norms and cache in the model's dtype
    (bf16 or float32), int4 projections."""

    input_norm: torch.Tensor
    post_attention_norm: torch.Tensor
    qkv: NativeInt4Linear | PortableInt4Linear
    o: NativeInt4Linear | PortableInt4Linear
    gate_up: NativeInt4Linear | PortableInt4Linear
    down: NativeInt4Linear | PortableInt4Linear
    kv_cache: torch.Tensor  # [2, blocks, block_size, kv_heads, head_dim], contiguous
    window: int = 0  # > 0: the layer's sliding window, in keys


def _int4_weight(linear: NativeInt4Linear | PortableInt4Linear) -> native_abi.Int4Weight:
    bias = linear.bias.data_ptr() if linear.bias is not None else None
    out_features, packed_inputs = linear.levels.shape
    return native_abi.Int4Weight(
        linear.levels.data_ptr(), linear.scales_zeros.data_ptr(), bias, out_features, 2 * packed_inputs
    )


def _head_shape_taken(kernels: native.NativeKernels, shape: LayerShape, dtype: torch.dtype) -> bool:
    """The bf16 step's attention takes whole `DECODE_HEAD_DIM_MULTIPLE`-dim chunks up to
    `DECODE_MAX_HEAD_DIM`; the float32 step's (the flash decode attention) whole vectors of the
    build up to `ATTENTION_MAX_HEAD_DIM`."""
    if shape.num_heads % shape.num_kv_heads != 0:
        return False
    if dtype == torch.bfloat16:
        multiple, largest = native_abi.DECODE_HEAD_DIM_MULTIPLE, native_abi.DECODE_MAX_HEAD_DIM
    else:
        multiple, largest = kernels.flash.flash_head_dim_multiple, native_abi.ATTENTION_MAX_HEAD_DIM
    return shape.head_dim % multiple == 0 and shape.head_dim <= largest


def supports_layers(
    kernels: native.NativeKernels, shape: LayerShape, layers: list[DecodeLayerWeights]
) -> bool:
    """Whether a native step of this build takes these layers: norms and caches all bf16 (on
    AVX512-BF16 builds) or all float32, contiguous CPU tensors, every projection the int4 kind
    that dtype's step runs, and a head shape its attention takes. Sliding windows: the float32
    step's only (its attention is the per-op path's flash decode; the bf16 step's exact paged
    kernel has none, and the per-op path takes other arithmetic for windowed bf16 rows)."""
    dtype = layers[0].kv_cache.dtype
    if dtype not in STEP_PROJECTIONS or (dtype == torch.bfloat16 and not kernels.has_decode_kernels):
        return False
    if dtype == torch.bfloat16 and any(layer.window for layer in layers):
        return False
    projection_kind = STEP_PROJECTIONS[dtype]
    return _head_shape_taken(kernels, shape, dtype) and all(
        layer.input_norm.dtype == layer.post_attention_norm.dtype == layer.kv_cache.dtype == dtype
        and layer.kv_cache.is_contiguous() and layer.kv_cache.device.type == "cpu"
        and layer.input_norm.is_contiguous() and layer.post_attention_norm.is_contiguous()
        and all(
            isinstance(projection, projection_kind)
            for projection in (layer.qkv, layer.o, layer.gate_up, layer.down)
        )
        for layer in layers
    )


class NativeDecodeStep:
    """Holds the layers' weights and caches (keeping them alive for the pointers it passes)."""

    def __init__(
        self, kernels: native.NativeKernels, shape: LayerShape, layers: list[DecodeLayerWeights]
    ) -> None:
        if not supports_layers(kernels, shape, layers):
            raise ValueError(
                "native decode: needs norms and caches all bf16 (AVX512-BF16 builds, NativeInt4Linear "
                "projections, no sliding window) or all float32 (PortableInt4Linear projections), and "
                f"a head size its attention takes, got {shape.num_heads} heads of {shape.head_dim} over "
                f"{shape.num_kv_heads} KV heads"
            )
        self.kernels = kernels
        self.layers = layers
        self._layer_array = (native_abi.DecodeLayer * len(layers))(
            *(
                native_abi.DecodeLayer(
                    layer.input_norm.data_ptr(),
                    layer.post_attention_norm.data_ptr(),
                    _int4_weight(layer.qkv),
                    _int4_weight(layer.o),
                    _int4_weight(layer.gate_up),
                    _int4_weight(layer.down),
                    layer.kv_cache.data_ptr(),
                    layer.window,
                )
                for layer in layers
            )
        )
        self.block_size = layers[0].kv_cache.shape[2]
        self._model = native_abi.DecodeModel(
            *shape.model_fields(len(layers), layers[0].kv_cache), ctypes.addressof(self._layer_array)
        )

    def run(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, tables: DecodeTables
    ) -> torch.Tensor:
        """tables: of at most `native_abi.DECODE_MAX_ROWS` sequences. hidden: the step's
        embeddings, contiguous [rows, hidden_size] in the layers' dtype, replaced by the last
        layer's output plus its residual; cos and sin contiguous [rows, 1, head_dim], likewise."""
        num_sequences, max_blocks = tables.block_table.shape
        batch = native_abi.DecodeBatch(
            num_sequences,
            max_blocks,
            self.block_size,
            tables.slot_mapping.data_ptr(),
            tables.block_table.data_ptr(),
            tables.seq_lens.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
        )
        self.kernels.steps.decode_step(self._model, batch, hidden)
        return hidden
