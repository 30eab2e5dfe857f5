"""A whole int4 decode step of a Llama-family model in one native call (csrc/decode_step.c).

Decode on a CPU is bound by reading the weights and, in torch, by dispatch: some 40 small
ops per layer at a few microseconds each, more than the layer's int4 matmuls take. Here
every layer (norms, int4 projections, rotary, the KV write, attention over the paged cache,
SwiGLU) runs in one call on torch's OpenMP threads, rounding its bf16 activations where the
per-op path does. It serves steps of only decodes, at most `native.DECODE_MAX_ROWS` of them,
on models whose projections are all `NativeInt4Linear`; every other step takes the per-op path.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from firsttoken.attention.backend import DecodeTables
from firsttoken.ops import native
from firsttoken.ops.linear import NativeInt4Linear

MAX_HEAD_DIM = 128
_POINTER = ctypes.c_void_p
_INT64 = ctypes.c_int64


class _Int4Weight(ctypes.Structure):
    _fields_ = [
        ("levels", _POINTER), ("scales_zeros", _POINTER), ("bias", _POINTER),
        ("out_features", _INT64), ("in_features", _INT64),
    ]


class _DecodeLayer(ctypes.Structure):
    _fields_ = [
        ("input_norm", _POINTER), ("post_attention_norm", _POINTER),
        ("qkv", _Int4Weight), ("o", _Int4Weight), ("gate_up", _Int4Weight), ("down", _Int4Weight),
        ("kv_cache", _POINTER),
    ]


class _DecodeModel(ctypes.Structure):
    _fields_ = [
        ("num_layers", _INT64), ("hidden_size", _INT64), ("num_heads", _INT64), ("num_kv_heads", _INT64),
        ("head_dim", _INT64), ("intermediate_size", _INT64), ("num_slots", _INT64),
        ("rms_norm_eps", ctypes.c_float), ("attention_scale", ctypes.c_float),
        ("layers", ctypes.POINTER(_DecodeLayer)),
    ]


class _DecodeBatch(ctypes.Structure):
    _fields_ = [
        ("num_sequences", _INT64), ("max_blocks", _INT64), ("block_size", _INT64),
        ("slot_mapping", _POINTER), ("block_table", _POINTER), ("seq_lens", _POINTER),
        ("cos", _POINTER), ("sin", _POINTER),
    ]


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


def _int4_weight(linear: NativeInt4Linear) -> _Int4Weight:
    bias = linear.bias.data_ptr() if linear.bias is not None else None
    out_features, packed_inputs = linear.levels.shape
    return _Int4Weight(linear.levels.data_ptr(), linear.scales_zeros.data_ptr(), bias, out_features, 2 * packed_inputs)


def supports_layers(shape: DecodeShape, layers: list[DecodeLayerWeights]) -> bool:
    """Whether the native step takes these: bf16 norms and caches, a head size of 32 to 128
    in whole 32-dim chunks."""
    return shape.head_dim % 32 == 0 and shape.head_dim <= MAX_HEAD_DIM and all(
        layer.input_norm.dtype == layer.post_attention_norm.dtype == layer.kv_cache.dtype == torch.bfloat16
        and layer.kv_cache.is_contiguous() and layer.kv_cache.device.type == "cpu"
        and layer.input_norm.is_contiguous() and layer.post_attention_norm.is_contiguous()
        for layer in layers
    )


class NativeDecodeStep:
    """Holds the layers' weights and caches (keeping them alive for the pointers it passes)."""

    def __init__(self, kernels: native.NativeKernels, shape: DecodeShape, layers: list[DecodeLayerWeights]) -> None:
        if not supports_layers(shape, layers):
            raise ValueError(
                f"native decode: needs bf16 norms and caches and a head size of 32 to {MAX_HEAD_DIM} in whole "
                f"32-dim chunks, got {shape.head_dim}"
            )
        self.kernels = kernels
        self.layers = layers
        self._layer_array = (_DecodeLayer * len(layers))(
            *(
                _DecodeLayer(
                    layer.input_norm.data_ptr(), layer.post_attention_norm.data_ptr(), _int4_weight(layer.qkv),
                    _int4_weight(layer.o), _int4_weight(layer.gate_up), _int4_weight(layer.down),
                    layer.kv_cache.data_ptr(),
                )
                for layer in layers
            )
        )
        cache_shape = layers[0].kv_cache.shape
        self.block_size = cache_shape[2]
        self._model = _DecodeModel(
            len(layers), shape.hidden_size, shape.num_heads, shape.num_kv_heads, shape.head_dim,
            shape.intermediate_size, cache_shape[1] * cache_shape[2], shape.rms_norm_eps, shape.head_dim**-0.5,
            self._layer_array,
        )

    def run(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, tables: DecodeTables) -> torch.Tensor:
        """tables: of at most `native.DECODE_MAX_ROWS` sequences. hidden: the step's embeddings, bf16 contiguous [rows, hidden_size], replaced by the
        last layer's output plus its residual; cos and sin contiguous bf16 [rows, 1, head_dim]."""
        num_sequences, max_blocks = tables.block_table.shape
        batch = _DecodeBatch(
            num_sequences, max_blocks, self.block_size, tables.slot_mapping.data_ptr(), tables.block_table.data_ptr(),
            tables.seq_lens.data_ptr(), cos.data_ptr(), sin.data_ptr(),
        )
        self.kernels.decode_step(self._model, batch, hidden)
        return hidden
