"""Step inputs shipped from the host to the device in one non-blocking copy.

On an accelerator, `torch.tensor(list, device=...)` copies from pageable memory and blocks the
host. Here a step's small arrays are packed into a reusable pinned buffer and copied with
`non_blocking=True`, so preparing step N+1 on the host overlaps step N on the device.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch


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
