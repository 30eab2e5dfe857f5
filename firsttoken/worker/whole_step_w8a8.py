"""The native whole-step W8A8 forward: every layer of a step in one native call
(ops/native_w8a8_step.py), for a bf16 Llama model whose projections are all W8A8 on the native
int8 matmul, on AVX512-BF16 builds.

The runner takes it for the steps it serves and runs the model's forward for every other one;
the model itself knows nothing of it.
"""

from __future__ import annotations

import torch

from firsttoken.arithmetic import ceil_div
from firsttoken.attention.backend import BatchLayout, decode_tables
from firsttoken.attention.cpu_backend import CPUAttentionBackend, first_of_run
from firsttoken.models.llama import LlamaForCausalLM
from firsttoken.ops.native_w8a8_step import (
    NativeW8A8Step,
    PrefillChunk,
    W8A8StepLayerWeights,
    supports_layers,
)
from firsttoken.worker.whole_step_layers import layer_shape, whole_step_unsupported_reason


class WholeStepW8A8:
    """Owns the native step over a model's weights and KV caches; reads the model's embedding
    and rotary table for the step's inputs."""

    def __init__(self, model: LlamaForCausalLM, native_step: NativeW8A8Step) -> None:
        self.model = model
        self.native_step = native_step

    @staticmethod
    def takes(layout: BatchLayout) -> bool:
        """Whether the step is one it serves: every step with rows (decode rows, prefill chunks,
        both)."""
        return len(layout.sequences) > 0

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
        num_decodes = layout.num_decodes
        decodes = layout.sequences[:num_decodes]
        tables = decode_tables(decodes, layout.block_size, slot_mapping[:num_decodes]) if decodes else None
        chunks = prefill_chunks(layout)
        hidden, residual = self.native_step.run(hidden, cos, sin, slot_mapping, tables, chunks)
        return hidden + residual


def prefill_chunks(layout: BatchLayout) -> list[PrefillChunk]:
    """Each prefill chunk's rows (after the decode rows), context and blocks, with the slot of its
    sequence's first key where those blocks are consecutive ids (its keys read in place), else -1
    (gathered)."""
    chunks = []
    first_row = layout.num_decodes
    for sequence in layout.sequences[layout.num_decodes :]:
        block_ids = sequence.block_table[: ceil_div(sequence.seq_len, layout.block_size)]
        context = sequence.num_context_tokens
        # Fresh keys are read from the step's own rows: their blocks matter only after context.
        first_block = first_of_run(block_ids) if context else None
        first_slot = first_block * layout.block_size if first_block is not None else -1
        chunks.append(PrefillChunk(first_row, sequence.query_len, context, list(block_ids), first_slot))
        first_row += sequence.query_len
    return chunks


def build_whole_step_w8a8(model: LlamaForCausalLM) -> WholeStepW8A8 | None:
    """The whole-step W8A8 forward of a model with its KV caches bound, for a model a whole step
    can run (`whole_step_unsupported_reason`) without a sliding window: bf16 layers on the CPU
    backend's native attention, every projection W8A8 on the native int8 matmul; None elsewhere."""
    native_kernels = model.kernels.native
    backends = {layer.self_attn.backend for layer in model.layers}
    if (
        whole_step_unsupported_reason(model) is not None or model.has_sliding_window
        or len(backends) != 1 or model.embed_weight.dtype != torch.bfloat16
    ):
        return None
    (backend,) = backends
    if not isinstance(backend, CPUAttentionBackend) or backend.native is None:
        return None
    layers = [
        W8A8StepLayerWeights(
            layer.input_norm_weight,
            layer.post_attention_norm_weight,
            layer.self_attn.qkv_proj,
            layer.self_attn.o_proj,
            layer.mlp.gate_up_proj,
            layer.mlp.down_proj,
            layer.self_attn.kv_cache,
        )
        for layer in model.layers
    ]
    shape = layer_shape(model.arch)
    if not supports_layers(native_kernels, shape, layers):
        return None
    # As the backend's decode rows attend: with the prefill kernel's arithmetic where it asks.
    block_size = layers[0].kv_cache.shape[2]
    decode_as_prefill = backend.decode_as_prefill and backend.decodes_as_prefill(
        block_size, torch.bfloat16, model.arch.head_dim
    )
    return WholeStepW8A8(model, NativeW8A8Step(native_kernels, shape, layers, decode_as_prefill))
