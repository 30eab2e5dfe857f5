"""The attention backend interface, the host-side description of a batch it turns into
tensors, and the one builder of a step's addressing: block tables and query rows.

A step's tokens are laid out flat, decodes (one new token each) first, then prefill chunks.
Each sequence brings `num_context_tokens` tokens already in the paged cache and `query_len`
new ones whose K/V this step writes through the slot mapping.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import numpy as np
import torch

from firsttoken.arithmetic import ceil_div
from firsttoken.ops.native_step_inputs import DecodeTables


@dataclass(frozen=True)
class LayerAttention:
    """How one layer's queries attend, beyond causal softmax over every earlier key."""

    sliding_window: int | None = None  # each query over its last that many keys
    logit_softcap: float | None = None  # scaled scores s taken as cap * tanh(s / cap) (Gemma 2)
    # StreamingLLM (with a window): the first keys every query sees too, scored with its sink
    # query, the query rotated at its position in the sinks-plus-window cache.
    sink_tokens: int = 0

    @property
    def is_plain(self) -> bool:
        return self.sliding_window is None and self.logit_softcap is None and not self.sink_tokens

    @property
    def last_cache_position(self) -> int | None:
        """With sinks: the position of a query in a full sinks-plus-window cache, where its
        sink query is rotated (earlier queries' sink queries are their queries)."""
        if not self.sink_tokens or self.sliding_window is None:
            return None
        return self.sink_tokens + self.sliding_window - 1


PLAIN_ATTENTION = LayerAttention()


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

    def query_rows(self) -> list[tuple[int, int, int]]:
        """(first query row, context length, query length) of each sequence, in batch order:
        what the chunk kernel's tiles are cut from."""
        rows = []
        first_row = 0
        for sequence in self.sequences:
            rows.append((first_row, sequence.num_context_tokens, sequence.query_len))
            first_row += sequence.query_len
        return rows


def write_block_tables(sequences: Sequence[SequenceLayout], block_size: int, table: np.ndarray) -> None:
    """Row i of `table` [>= S, >= blocks of the longest] starts with the blocks holding sequence
    i's tokens; the rest of the row stays as it was (past a sequence's length, no kernel reads)."""
    for row, sequence in enumerate(sequences):
        num_blocks = ceil_div(sequence.seq_len, block_size)
        table[row, :num_blocks] = sequence.block_table[:num_blocks]


def block_table_array(
    sequences: Sequence[SequenceLayout], block_size: int, dtype: type[np.integer] = np.int32
) -> np.ndarray:
    """[S, blocks of the longest]: each row the blocks holding its sequence's tokens, then zeros."""
    max_blocks = max(ceil_div(sequence.seq_len, block_size) for sequence in sequences)
    table = np.zeros((len(sequences), max_blocks), dtype=dtype)
    write_block_tables(sequences, block_size, table)
    return table


def decode_tables(
    decodes: Sequence[SequenceLayout], block_size: int, slot_mapping: torch.Tensor
) -> DecodeTables:
    """The addressing of a step's decode rows (`slot_mapping` holds theirs, in their order)."""
    device = slot_mapping.device
    return DecodeTables(
        slot_mapping.contiguous(),
        torch.from_numpy(block_table_array(decodes, block_size, np.int64)).to(device),
        torch.tensor([sequence.seq_len for sequence in decodes], dtype=torch.long, device=device),
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
        layer: LayerAttention = PLAIN_ATTENTION,
        sink_query: torch.Tensor | None = None,  # [T, num_heads, head_dim], with layer.sink_tokens
    ) -> torch.Tensor: ...  # [T, num_heads, head_dim]
