"""A step's flat inputs built on the host as NumPy arrays: the one place a scheduled batch
becomes input ids, positions, slot mapping and the rows that sample.

Rows of one-token chunks (decodes) come first, then prefill chunks. The arrays are staged to
the device in one copy (attention/staging.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from firsttoken.attention.backend import BatchLayout, SequenceLayout
from firsttoken.core.batch import ScheduledChunk


@dataclass
class HostStep:
    """A step's flat inputs as host index arrays, rows in batch order (one-token chunks first)."""

    chunks: list[ScheduledChunk]  # in row order
    input_ids: np.ndarray  # [T]
    positions: np.ndarray  # [T]
    slot_mapping: np.ndarray  # [T]
    sample_rows: np.ndarray  # [R]: the last row of each chunk that samples (a verify chunk's last 1 + drafts)
    layout: BatchLayout

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def is_decode_only(self) -> bool:
        return self.layout.num_decodes == len(self.chunks)

    @property
    def samples_every_row(self) -> bool:
        return self.sample_rows.shape[0] == self.num_tokens


def order_decodes_first(chunks: list[ScheduledChunk]) -> list[ScheduledChunk]:
    decodes = [chunk for chunk in chunks if chunk.is_decode]
    prefills = [chunk for chunk in chunks if not chunk.is_decode]
    return decodes + prefills


def build_host_step(
    chunks: list[ScheduledChunk], block_size: int, index_dtype: type[np.integer] = np.int32
) -> HostStep:
    """The step's arrays in `index_dtype` (the attention backend's index type)."""
    ordered = order_decodes_first(chunks)
    num_tokens = sum(chunk.num_tokens for chunk in ordered)
    input_ids = np.empty(num_tokens, dtype=index_dtype)
    positions = np.empty(num_tokens, dtype=index_dtype)
    slot_mapping = np.empty(num_tokens, dtype=index_dtype)
    sample_rows = []
    sequences = []
    row = 0
    for chunk in ordered:
        start, count = chunk.start_position, chunk.num_tokens
        if count == 1:
            # Scalar arithmetic: NumPy's per-call overhead would dominate a batch of decodes.
            input_ids[row] = chunk.token_ids[0]
            positions[row] = start
            slot_mapping[row] = chunk.block_table[start // block_size] * block_size + start % block_size
        else:
            chunk_positions = np.arange(start, start + count, dtype=index_dtype)
            table = np.asarray(chunk.block_table, dtype=index_dtype)
            input_ids[row : row + count] = chunk.token_ids
            positions[row : row + count] = chunk_positions
            slot_mapping[row : row + count] = table[chunk_positions // block_size] * block_size + (
                chunk_positions % block_size
            )
        row += count
        sample_rows.extend(range(row - chunk.num_sampled_rows, row))
        sequences.append(SequenceLayout(count, start, chunk.block_table))
    num_decodes = sum(1 for chunk in ordered if chunk.is_decode)
    return HostStep(
        chunks=ordered,
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        sample_rows=np.asarray(sample_rows, dtype=index_dtype),
        layout=BatchLayout(sequences, num_decodes, block_size),
    )
