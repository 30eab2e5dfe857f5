"""Random paged-attention inputs: shuffled (non-contiguous) block tables, context K/V in the cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from firsttoken.attention.backend import BatchLayout, SequenceLayout
from firsttoken.attention.reference import write_kv_reference


@dataclass
class PagedInputs:
    """One step's layout and tensors; `key`/`value` are this step's new K/V (not yet written)."""

    layout: BatchLayout
    slot_mapping: torch.Tensor  # long [T]
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, kv_heads, D]
    query: torch.Tensor  # [T, heads, D]
    key: torch.Tensor  # [T, kv_heads, D]
    value: torch.Tensor  # [T, kv_heads, D]


def slots_of(sequence: SequenceLayout, block_size: int, start: int, end: int) -> torch.Tensor:
    positions = torch.arange(start, end)
    return torch.tensor(sequence.block_table)[positions // block_size] * block_size + positions % block_size


def random_paged_inputs(
    seqs: list[tuple[int, int]],
    num_decodes: int,
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
) -> PagedInputs:
    """seqs: (num_context_tokens, query_len) per sequence, the first `num_decodes` with query_len 1."""
    generator = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-(context + query) // block_size) for context, query in seqs]
    num_blocks = sum(blocks_needed) + 3
    order = torch.randperm(num_blocks, generator=generator).tolist()
    # Unwritten slots hold noise, so a read outside a sequence's keys would show.
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=generator).to(dtype)
    sequences, cursor = [], 0
    for (context, query_len), needed in zip(seqs, blocks_needed):
        sequence = SequenceLayout(query_len, context, order[cursor : cursor + needed])
        cursor += needed
        sequences.append(sequence)
        if context:
            shape = (context, num_kv_heads, head_dim)
            write_kv_reference(
                kv_cache,
                torch.randn(shape, generator=generator).to(dtype),
                torch.randn(shape, generator=generator).to(dtype),
                slots_of(sequence, block_size, 0, context),
            )
    layout = BatchLayout(sequences, num_decodes, block_size)
    slot_mapping = torch.cat([slots_of(s, block_size, s.num_context_tokens, s.seq_len) for s in sequences])
    total = layout.num_tokens
    return PagedInputs(
        layout=layout,
        slot_mapping=slot_mapping.to(device),
        kv_cache=kv_cache.to(device),
        query=torch.randn(total, num_heads, head_dim, generator=generator).to(dtype).to(device),
        key=torch.randn(total, num_kv_heads, head_dim, generator=generator).to(dtype).to(device),
        value=torch.randn(total, num_kv_heads, head_dim, generator=generator).to(dtype).to(device),
    )
