"""The attention backend interface and the host-side description of a batch it turns into tensors.

A step's tokens are laid out flat, decodes (one new token each) first, then prefill chunks.
Each sequence brings `num_context_tokens` tokens already in the paged cache and `query_len`
new ones whose K/V this step writes through the slot mapping.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from firsttoken.ops.native_decode import DecodeTables


@dataclass(frozen=True)
class SequenceLayout:
    """One sequence of a step: how many new tokens, how much context before them, its blocks."""

    query_len: int
    num_context_tokens: int
    block_table: list[int]

    @property
    def seq_len(self) -> int:
        return self.num_context_tokens + self.query_len


@dataclass(frozen=True)
class BatchLayout:
    """All sequences of a step in batch order (decodes first); plain data, no tensors."""

    sequences: list[SequenceLayout]
    num_decodes: int
    block_size: int

    @property
    def num_tokens(self) -> int:
        return sum(sequence.query_len for sequence in self.sequences)


def decode_tables(decodes: list[SequenceLayout], block_size: int, slot_mapping: torch.Tensor) -> DecodeTables:
    """The addressing of a step's decode rows (`slot_mapping` holds theirs, in their order)."""
    seq_lens = [sequence.seq_len for sequence in decodes]
    max_blocks = -(-max(seq_lens) // block_size)
    rows = [sequence.block_table[:max_blocks] for sequence in decodes]
    table = [row + [0] * (max_blocks - len(row)) for row in rows]
    return DecodeTables(
        slot_mapping.contiguous(),
        torch.tensor(table, dtype=torch.long, device=slot_mapping.device),
        torch.tensor(seq_lens, dtype=torch.long, device=slot_mapping.device),
    )


class AttentionBackend(Protocol):
    """Turns a BatchLayout into backend metadata once a step, then runs every layer with it."""

    # The integer type its step inputs (ids, positions, slot mapping) must have.
    index_dtype: torch.dtype

    def build_metadata(self, layout: BatchLayout, slot_mapping: torch.Tensor) -> Any: ...

    def forward(
        self,
        query: torch.Tensor,  # [T, num_heads, head_dim]
        key: torch.Tensor,  # [T, num_kv_heads, head_dim]
        value: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: Any,
    ) -> torch.Tensor: ...  # [T, num_heads, head_dim]
