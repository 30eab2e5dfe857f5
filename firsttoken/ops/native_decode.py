"""A whole int4 decode step of a Llama-family model in one native call (csrc/decode_step.c).

Decode on a CPU is bound by reading the weights and, in torch, by dispatch: some 40 small
ops per layer at a few microseconds each, more than the layer's int4 matmuls take. Here
every layer (norms, int4 projections, rotary, the KV write, attention over the paged cache,
SwiGLU) runs in one call on torch's OpenMP threads, rounding its bf16 activations where the
per-op path does. It serves steps of only decodes, at most `native_abi.DECODE_MAX_ROWS` of
them, on models whose projections are all `NativeInt4Linear`; every other step takes the
per-op path.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from firsttoken.ops import native, native_abi
from firsttoken.ops.linear import NativeInt4Linear


@dataclass(frozen=True)
class DecodeTables:
    """A decode-only step's addressing as tensors, for a kernel that runs the whole step."""

    slot_mapping: torch.Tensor  # long [B]
    block_table: torch.Tensor  # long [B, max_blocks], short rows padded with block 0
    seq_lens: torch.Tensor  # long [B]: keys each sequence attends over, its new one included


@dataclass
class DecodeLayerWeights:
    """One decoder layer as the native step reads it: bf16 norms, int4 projections, its cache."""

    input_norm: torch.Tensor
    post_attention_norm: torch.Tensor
    qkv: NativeInt4Linear
    o: NativeInt4Linear
    gate_up: NativeInt4Linear
    down: NativeInt4Linear
    kv_cache: torch.Tensor  # bf16 [2, blocks, block_size, kv_heads, head_dim], contiguous


@dataclass(frozen=True)
class DecodeShape:
    """The model dimensions the step needs."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float


def _int4_weight(linear: NativeInt4Linear) -> native_abi.Int4Weight:
    bias = linear.bias.data_ptr() if linear.bias is not None else None
    out_features, packed_inputs = linear.levels.shape
    return native_abi.Int4Weight(
        linear.levels.data_ptr(), linear.scales_zeros.data_ptr(), bias, out_features, 2 * packed_inputs
    )


def supports_layers(shape: DecodeShape, layers: list[DecodeLayerWeights]) -> bool:
    """Whether the native step takes these: bf16 norms and caches, a head size of whole
    `native_abi.DECODE_HEAD_DIM_MULTIPLE`-dim chunks up to `native_abi.DECODE_MAX_HEAD_DIM`."""
    head_dim_taken = (
        shape.head_dim % native_abi.DECODE_HEAD_DIM_MULTIPLE == 0
        and shape.head_dim <= native_abi.DECODE_MAX_HEAD_DIM
    )
    return head_dim_taken and all(
        layer.input_norm.dtype == layer.post_attention_norm.dtype == layer.kv_cache.dtype == torch.bfloat16
        and layer.kv_cache.is_contiguous() and layer.kv_cache.device.type == "cpu"
        and layer.input_norm.is_contiguous() and layer.post_attention_norm.is_contiguous()
        for layer in layers
    )


class NativeDecodeStep:
    """Holds the layers' weights and caches (keeping them alive for the pointers it passes)."""

    def __init__(
        self, kernels: native.NativeKernels, shape: DecodeShape, layers: list[DecodeLayerWeights]
    ) -> None:
        if not supports_layers(shape, layers):
            raise ValueError(
                "native decode: needs bf16 norms and caches and a head size of "
                f"{native_abi.DECODE_HEAD_DIM_MULTIPLE} to {native_abi.DECODE_MAX_HEAD_DIM} in whole "
                f"{native_abi.DECODE_HEAD_DIM_MULTIPLE}-dim chunks, got {shape.head_dim}"
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
                )
                for layer in layers
            )
        )
        cache_shape = layers[0].kv_cache.shape
        self.block_size = cache_shape[2]
        self._model = native_abi.DecodeModel(
            len(layers),
            shape.hidden_size,
            shape.num_heads,
            shape.num_kv_heads,
            shape.head_dim,
            shape.intermediate_size,
            cache_shape[1] * cache_shape[2],
            shape.rms_norm_eps,
            shape.head_dim**-0.5,
            ctypes.addressof(self._layer_array),
        )

    def run(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, tables: DecodeTables
    ) -> torch.Tensor:
        """tables: of at most `native_abi.DECODE_MAX_ROWS` sequences. hidden: the step's
        embeddings, bf16 contiguous [rows, hidden_size], replaced by the last layer's output
        plus its residual; cos and sin contiguous bf16 [rows, 1, head_dim]."""
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
        self.kernels.decode_step(self._model, batch, hidden)
        return hidden
