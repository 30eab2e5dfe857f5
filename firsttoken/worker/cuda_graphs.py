"""Decode steps replayed from captured graphs.

A decode step launches a few kernels per layer on tiny tensors, so its time is the host's
launch overhead; a captured graph replays them all in one call. Graphs have fixed shapes and
addresses, so one is captured per batch size of a ladder (1, 2, 4, 8, 16, then every 16 up to
`max_num_seqs`), each reading static input buffers, and a batch is padded to the next size.

Padding rows are harmless by construction: each is a one-token sequence at position 0 whose
block table points at a scratch block that the KV cache manager never hands out, so it writes
its K/V there, reads only that slot back, and is never sampled.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from firsttoken.attention.cuda_backend import CudaAttentionBackend
from firsttoken.models.llama import LlamaForCausalLM
from firsttoken.attention.staging import wait_for_copy
from firsttoken.worker.step_inputs import HostStep

Forward = Callable[[], torch.Tensor]

# Rows of the static scalar inputs.
_INPUT_IDS, _POSITIONS, _SLOTS, _SEQ_LENS = range(4)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """The ladder of captured batch sizes: 1, 2, 4, 8, 16, then every 16, ending at max_num_seqs."""
    sizes = [size for size in (1, 2, 4, 8, 16) if size < max_num_seqs]
    sizes += list(range(32, max_num_seqs, 16))
    return sizes + [max_num_seqs]


def padded_batch_size(num_decodes: int, sizes: list[int]) -> int | None:
    """The smallest captured size holding `num_decodes` rows; None when none is large enough."""
    index = bisect.bisect_left(sizes, num_decodes)
    return sizes[index] if index < len(sizes) else None


@dataclass(frozen=True)
class GraphCaptureReport:
    """What capturing the decode graphs cost at start-up."""

    batch_sizes: tuple[int, ...]
    seconds: float
    device_memory_bytes: int  # taken on the device by the graphs' pool and static inputs; 0 on a CPU


def device_memory_in_use(device: torch.device) -> int:
    """Bytes in use on a CUDA device by every process (what a capture's pool adds to); 0 elsewhere."""
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return total - free


class GraphCapture(Protocol):
    """Turns a forward over static buffers into a replay returning the same output tensor."""

    def capture(self, forward: Forward) -> Forward: ...


class CudaGraphCapture:
    """Owns the captured CUDA graphs and the memory pool they share."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: list[torch.cuda.CUDAGraph] = []

    def capture(self, forward: Forward) -> Forward:
        # A first run outside capture compiles the Triton kernels and lets cuBLAS pick its
        # kernels and workspace; capture records launches only.
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            forward()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # The graphs share one pool, so one's intermediates may lie where another's output is.
        # That is safe because replays never overlap and a step consumes its output (logits)
        # before the next replay is queued.
        with torch.cuda.graph(graph, pool=self.pool):
            output = forward()
        self.graphs.append(graph)

        def replay() -> torch.Tensor:
            graph.replay()
            return output

        return replay


class DecodeGraphs:
    """Owns the static decode inputs (a pinned host mirror and their device buffers) and one
    replay per ladder size, each with its own output tensor."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        backend: CudaAttentionBackend,
        capture: GraphCapture,
        sizes: list[int],
        max_blocks_per_seq: int,
        scratch_block_id: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.sizes = sizes
        self.scratch_block_id = scratch_block_id
        self.block_size = block_size
        max_size = sizes[-1]
        pin = device.type != "cpu"
        self.host_scalars = torch.zeros((4, max_size), dtype=torch.int32, pin_memory=pin)
        self.host_tables = torch.zeros((max_size, max_blocks_per_seq), dtype=torch.int32, pin_memory=pin)
        self.scalars = torch.zeros_like(self.host_scalars, device=device)
        self.block_tables = torch.zeros_like(self.host_tables, device=device)
        self._copy_done: torch.Event | None = None
        # Every row starts as padding, so the warm-up and capture runs touch only the scratch block.
        self._write_padding(0, max_size)
        self._ship(max_size)
        self.replays: dict[int, Forward] = {}
        # Largest first: smaller graphs then fit in the memory pool the largest one sized.
        for size in reversed(sizes):
            self.replays[size] = capture.capture(self._forward(model, backend, size))

    def _forward(self, model: LlamaForCausalLM, backend: CudaAttentionBackend, size: int) -> Forward:
        input_ids, positions, slot_mapping, seq_lens = self.scalars[:, :size]
        metadata = backend.decode_metadata(slot_mapping, self.block_tables[:size], seq_lens)
        return lambda: model(input_ids, positions, metadata)

    def padded_size(self, step: HostStep) -> int | None:
        """The graph size that runs `step`; None if it must run eagerly."""
        if not step.is_decode_only:
            return None
        return padded_batch_size(step.num_tokens, self.sizes)

    def run(self, step: HostStep, size: int) -> torch.Tensor:
        """Hidden states [num_decodes, hidden] of a decode-only step, from the graph of `size` rows."""
        num_rows = step.num_tokens
        wait_for_copy(self._copy_done)  # the previous copy out of the host mirror
        scalars = self.host_scalars.numpy()
        scalars[_INPUT_IDS, :num_rows] = step.input_ids
        scalars[_POSITIONS, :num_rows] = step.positions
        scalars[_SLOTS, :num_rows] = step.slot_mapping
        scalars[_SEQ_LENS, :num_rows] = step.positions + 1
        tables = self.host_tables.numpy()
        for row, chunk in enumerate(step.chunks):
            num_blocks = chunk.start_position // self.block_size + 1
            tables[row, :num_blocks] = chunk.block_table[:num_blocks]
        self._write_padding(num_rows, size)
        self._ship(size)
        return self.replays[size]()[:num_rows]

    def _write_padding(self, start: int, end: int) -> None:
        scalars = self.host_scalars.numpy()
        scalars[_INPUT_IDS, start:end] = 0
        scalars[_POSITIONS, start:end] = 0
        scalars[_SLOTS, start:end] = self.scratch_block_id * self.block_size
        scalars[_SEQ_LENS, start:end] = 1
        self.host_tables.numpy()[start:end, 0] = self.scratch_block_id

    def _ship(self, num_rows: int) -> None:
        """Copy the scalars and the first `num_rows` block-table rows to the device, without blocking."""
        self.scalars.copy_(self.host_scalars, non_blocking=True)
        self.block_tables[:num_rows].copy_(self.host_tables[:num_rows], non_blocking=True)
        if self.scalars.device.type != "cpu":
            self._copy_done = torch.Event(device=self.scalars.device)
            self._copy_done.record()
