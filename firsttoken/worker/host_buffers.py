"""A step's inputs built on the host as NumPy arrays, and shipped to the device in one copy.

On an accelerator, `torch.tensor(list, device=...)` copies from pageable memory and blocks the
host. Here the arrays are packed into a reusable pinned buffer and copied with
`non_blocking=True`, so preparing step N+1 on the host overlaps step N on the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from firsttoken.attention.backend import BatchLayout, SequenceLayout
from firsttoken.core.batch import ScheduledChunk


@dataclass
class HostStep:
    """A step's flat inputs as int32 host arrays, rows in batch order (one-token chunks first)."""

    chunks: list[ScheduledChunk]  # in row order
    input_ids: np.ndarray  # [T]
    positions: np.ndarray  # [T]
    slot_mapping: np.ndarray  # [T]
    sample_rows: np.ndarray  # [R]: the last row of each chunk that samples
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


def build_host_step(chunks: list[ScheduledChunk], block_size: int) -> HostStep:
    """Rows of one-token chunks (decodes) first, then prefill chunks, as ModelRunner orders them."""
    ordered = [chunk for chunk in chunks if chunk.num_tokens == 1] + [c for c in chunks if c.num_tokens > 1]
    num_tokens = sum(chunk.num_tokens for chunk in ordered)
    input_ids = np.empty(num_tokens, dtype=np.int32)
    positions = np.empty(num_tokens, dtype=np.int32)
    slot_mapping = np.empty(num_tokens, dtype=np.int32)
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
            chunk_positions = np.arange(start, start + count, dtype=np.int32)
            table = np.asarray(chunk.block_table, dtype=np.int32)
            input_ids[row : row + count] = chunk.token_ids
            positions[row : row + count] = chunk_positions
            slot_mapping[row : row + count] = table[chunk_positions // block_size] * block_size + (
                chunk_positions % block_size
            )
        row += count
        if chunk.sample is not None:
            sample_rows.append(row - 1)
        sequences.append(SequenceLayout(count, start, chunk.block_table))
    num_decodes = sum(1 for chunk in ordered if chunk.num_tokens == 1)
    return HostStep(
        chunks=ordered,
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        sample_rows=np.asarray(sample_rows, dtype=np.int32),
        layout=BatchLayout(sequences, num_decodes, block_size),
    )


class StagingBuffer:
    """Owns a pinned host buffer and its device twin, of one dtype: a step packs its small
    arrays into the host side and ships them in a single non-blocking copy.

    The host side is rewritten every step, so before writing it waits for the previous copy
    out of it (an event, normally long complete; not a device-wide synchronisation). The
    device side needs no such wait: the next copy into it is queued behind the kernels that
    read it. A step larger than the buffers doubles them (pinned memory is allocated then,
    once). On the CPU the host buffer is the device buffer and nothing is copied.
    """

    def __init__(
        self, device: torch.device, dtype: torch.dtype = torch.int32, capacity: int = 1 << 14
    ) -> None:
        self.device = device
        self.dtype = dtype
        self._copy_done: torch.Event | None = None
        self._allocate(capacity)

    def _allocate(self, capacity: int) -> None:
        on_cpu = self.device.type == "cpu"
        self.host = torch.empty(capacity, dtype=self.dtype, pin_memory=not on_cpu)
        self.host_array = self.host.numpy()
        self.on_device = self.host if on_cpu else torch.empty(capacity, dtype=self.dtype, device=self.device)

    @property
    def capacity(self) -> int:
        return self.host.shape[0]

    def stage(self, arrays: Sequence[np.ndarray]) -> list[torch.Tensor]:
        """Device tensors holding `arrays` (same shapes), valid until the next `stage`."""
        total = sum(array.size for array in arrays)
        wait_for_copy(self._copy_done)
        if total > self.capacity:
            # Buffers still read by queued work stay alive through the caching allocators.
            self._allocate(max(total, 2 * self.capacity))
        spans = []
        offset = 0
        for array in arrays:
            self.host_array[offset : offset + array.size] = array.reshape(-1)
            spans.append((offset, array.shape))
            offset += array.size
        if self.on_device is not self.host:
            self.on_device[:total].copy_(self.host[:total], non_blocking=True)
            self._copy_done = torch.Event(device=self.device)
            self._copy_done.record()
        return [self.on_device[start : start + int(np.prod(shape))].view(shape) for start, shape in spans]


def wait_for_copy(copy_done: torch.Event | None) -> None:
    """Block until a recorded copy has finished; a query first, since it almost always has."""
    if copy_done is not None and not copy_done.query():
        copy_done.synchronize()
