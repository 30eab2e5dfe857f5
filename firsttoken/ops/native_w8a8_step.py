"""A W8A8 model's step in one native call (csrc/w8a8_step.c).

With every projection on the native int8 matmul, a step's layers are native kernels already:
per layer the qkv projection with its norm, rotary, the KV write, the attention (the paged decode
kernel for decode rows, the prefill kernel for prefill chunks), o_proj, the gate | up projection
with its norm and SwiGLU, and down_proj. What the forward adds between them is Python: the
modules, the views, the output tensors, ctypes, run slow after a kernel has evicted the
interpreter's data. Here the same kernels run in the same order on the same rows, in one call:
the same bits as the forward.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from firsttoken.ops import native, native_abi
from firsttoken.ops.hadamard import hadamard_norm
from firsttoken.ops.native_step_inputs import DecodeTables, LayerShape
from firsttoken.ops.w8a8_linear import W8A8Linear


@dataclass
class W8A8StepLayerWeights:
    """One decoder layer as the native step reads it: bf16 norms and cache, W8A8 projections."""

    input_norm: torch.Tensor
    post_attention_norm: torch.Tensor
    qkv: W8A8Linear
    o: W8A8Linear
    gate_up: W8A8Linear  # storing SwiGLU's product from its epilogue
    down: W8A8Linear
    kv_cache: torch.Tensor  # [2, blocks, block_size, kv_heads, head_dim], contiguous


@dataclass(frozen=True)
class PrefillChunk:
    """One prefill chunk of a step: its rows, the context tokens before them, and its sequence's
    blocks up to its last token."""

    first_row: int
    num_rows: int
    num_context_tokens: int
    block_ids: list[int]
    first_slot: int  # the cache slot of the sequence's first key; -1 where its blocks are not a run


def _weight(linear: W8A8Linear, in_features: int) -> native_abi.W8A8Weight:
    return native_abi.W8A8Weight(
        linear.packed_weight.data_ptr(),
        linear.weight_scales.data_ptr(),
        linear.bias.data_ptr() if linear.bias is not None else None,
        linear.input_scales.data_ptr() if linear.input_scales is not None else None,
        linear.hadamard_block,
        hadamard_norm(linear.hadamard_block),
        linear.weight_scales.shape[0],
        in_features,
    )


def _check_step(
    hidden: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slot_mapping: torch.Tensor,
    decodes: DecodeTables | None,
    prefills: list[PrefillChunk],
    block_size: int,
    head_dim: int,
) -> None:
    """Raises ValueError naming what does not fit the step's rows: the kernel trusts them."""
    num_tokens = hidden.shape[0]
    num_decodes = decodes.block_table.shape[0] if decodes is not None else 0
    row = num_decodes
    for chunk in prefills:
        if chunk.first_row != row or chunk.num_rows < 1 or chunk.num_context_tokens < 0:
            raise ValueError(f"W8A8 step: prefill chunk {chunk} does not start at row {row} with rows")
        if len(chunk.block_ids) * block_size < chunk.num_context_tokens + chunk.num_rows:
            raise ValueError(f"W8A8 step: prefill chunk {chunk} has too few blocks for its keys")
        row += chunk.num_rows
    if row != num_tokens or not hidden.is_contiguous() or hidden.dtype != torch.bfloat16:
        raise ValueError(
            f"W8A8 step: hidden must be contiguous bf16 of the {row} rows of its decodes and chunks, got "
            f"{tuple(hidden.shape)} {hidden.dtype}"
        )
    for name, tensor in (("cos", cos), ("sin", sin)):
        if (
            tensor.numel() != num_tokens * head_dim or tensor.shape[0] != num_tokens
            or not tensor.is_contiguous() or tensor.dtype != torch.bfloat16
        ):
            raise ValueError(f"W8A8 step: {name} must be contiguous bf16 [{num_tokens}, 1, {head_dim}]")
    if slot_mapping.shape != (num_tokens,) or slot_mapping.dtype != torch.long:
        raise ValueError(f"W8A8 step: slot_mapping must be long [{num_tokens}]")


def _projection_shapes(layer: W8A8StepLayerWeights, shape: LayerShape) -> bool:
    """Whether the layer's projections and cache have the shapes the step sizes its rows for."""
    q_size, kv_size = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    outputs = (
        (layer.qkv, q_size + 2 * kv_size),
        (layer.o, shape.hidden_size),
        (layer.gate_up, 2 * shape.intermediate_size),
        (layer.down, shape.hidden_size),
    )
    return (
        all(projection.weight_scales.shape[0] == size for projection, size in outputs)
        and layer.kv_cache.dim() == 5
        and tuple(layer.kv_cache.shape[3:]) == (shape.num_kv_heads, shape.head_dim)
        and tuple(layer.input_norm.shape) == tuple(layer.post_attention_norm.shape) == (shape.hidden_size,)
    )


def supports_layers(
    kernels: native.NativeKernels, shape: LayerShape, layers: list[W8A8StepLayerWeights]
) -> bool:
    """Whether this build's step takes these layers: the bf16 prefill and paged decode attention
    (AVX512-BF16 builds) for this head shape, bf16 norms and contiguous bf16 caches, and every
    projection a W8A8 one on the native int8 matmul, gate_up storing SwiGLU's product."""
    head_dim = shape.head_dim
    if (
        not kernels.steps.has_w8a8_step
        or not kernels.has_decode_kernels
        or head_dim % native_abi.PREFILL_HEAD_DIM_MULTIPLE != 0
        or head_dim % native_abi.DECODE_HEAD_DIM_MULTIPLE != 0
        or head_dim > min(native_abi.PREFILL_MAX_HEAD_DIM, native_abi.DECODE_MAX_HEAD_DIM)
        or shape.num_heads % shape.num_kv_heads != 0
    ):
        return False
    return all(
        all(
            tensor.dtype == torch.bfloat16 and tensor.device.type == "cpu" and tensor.is_contiguous()
            for tensor in (layer.input_norm, layer.post_attention_norm, layer.kv_cache)
        )
        and all(
            isinstance(projection, W8A8Linear) and projection.native_matmul
            for projection in (layer.qkv, layer.o, layer.gate_up, layer.down)
        )
        and layer.gate_up.makes_swiglu_product
        and _projection_shapes(layer, shape)
        and layer.kv_cache.shape == layers[0].kv_cache.shape
        for layer in layers
    )


class NativeW8A8Step:
    """Holds the layers' weights and caches (keeping them alive for the pointers it passes)."""

    def __init__(
        self,
        kernels: native.NativeKernels,
        shape: LayerShape,
        layers: list[W8A8StepLayerWeights],
        decode_as_prefill: bool,
    ) -> None:
        if not supports_layers(kernels, shape, layers):
            raise ValueError(
                "native W8A8 step: needs the bf16 attention kernels (AVX512-BF16 builds) for "
                f"{shape.num_heads} heads of {shape.head_dim} over {shape.num_kv_heads} KV heads, bf16 "
                "norms and caches, and every projection W8A8 on the native int8 matmul"
            )
        self.kernels = kernels
        self.layers = layers
        q_size = shape.num_heads * shape.head_dim
        self._layer_array = (native_abi.W8A8StepLayer * len(layers))(
            *(
                native_abi.W8A8StepLayer(
                    layer.input_norm.data_ptr(),
                    layer.post_attention_norm.data_ptr(),
                    _weight(layer.qkv, shape.hidden_size),
                    _weight(layer.o, q_size),
                    _weight(layer.gate_up, shape.hidden_size),
                    _weight(layer.down, shape.intermediate_size),
                    layer.kv_cache.data_ptr(),
                )
                for layer in layers
            )
        )
        self.block_size = layers[0].kv_cache.shape[2]
        self.head_dim = shape.head_dim
        self._model = native_abi.W8A8StepModel(
            *shape.model_fields(len(layers), layers[0].kv_cache),
            int(kernels.w8a8.w8a8_matmul_uses_amx),
            int(kernels.has_amx),
            int(decode_as_prefill),
            ctypes.addressof(self._layer_array),
        )

    def run(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slot_mapping: torch.Tensor,
        decodes: DecodeTables | None,
        prefills: list[PrefillChunk],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden: the step's embeddings, contiguous bf16 [T, hidden_size], replaced by the last
        layer's output; cos and sin contiguous bf16 [T, 1, head_dim]; slot_mapping long [T]; the
        decode rows first (their tables; None for none), then the prefill chunks in row order.
        Returns (hidden, the residual after the last add): the model's output is their sum."""
        _check_step(hidden, cos, sin, slot_mapping, decodes, prefills, self.block_size, self.head_dim)
        slot_mapping = slot_mapping.contiguous()
        residual = torch.empty_like(hidden)
        rows = [[chunk.first_row, chunk.num_rows, chunk.num_context_tokens] for chunk in prefills]
        chunks = torch.tensor(rows, dtype=torch.long)
        first_slots = torch.tensor([chunk.first_slot for chunk in prefills], dtype=torch.long)
        max_prefill_blocks = max((len(chunk.block_ids) for chunk in prefills), default=0)
        prefill_blocks = torch.zeros(len(prefills), max_prefill_blocks, dtype=torch.long)
        for row, chunk in enumerate(prefills):
            prefill_blocks[row, : len(chunk.block_ids)] = torch.tensor(chunk.block_ids, dtype=torch.long)
        num_decodes, max_blocks = decodes.block_table.shape if decodes is not None else (0, 0)
        batch = native_abi.W8A8StepBatch(
            hidden.shape[0],
            num_decodes,
            self.block_size,
            max_blocks,
            decodes.block_table.data_ptr() if decodes is not None else None,
            decodes.seq_lens.data_ptr() if decodes is not None else None,
            len(prefills),
            chunks.data_ptr(),
            first_slots.data_ptr(),
            max_prefill_blocks,
            prefill_blocks.data_ptr(),
            slot_mapping.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
        )
        self.kernels.steps.w8a8_step(self._model, batch, hidden, residual)
        return hidden, residual
