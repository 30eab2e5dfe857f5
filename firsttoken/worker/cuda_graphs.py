"""Steps replayed from captured CUDA graphs.

A step launches a few kernels per layer; unless it is long, its time is the host's launch
overhead, and a captured graph replays all of them in one call. Graphs have fixed shapes and
addresses, so each reads static input buffers and is captured once per size of a ladder; a
step is padded to the next captured size.

- Decode-only steps (`DecodeGraphs`): one graph per batch size (1, 2, 4, 8, 16, then every 16
  up to `max_num_seqs`); decodes attend with the decode kernel.
- Steps with prefill rows (`StepGraphs`: prompts, chunks, verification of drafts, with or
  without decodes): one graph per token count (`graph_token_sizes`). Every row attends through
  the chunk kernel, which reads its tiles from a device table of fixed length, so the launch
  shapes depend only on the token count, never on how the tokens split into sequences.

Padding is harmless by construction: padding tokens sit at position 0 and write their K/V to a
scratch block that the KV cache manager never hands out; padding decode rows read only that
block; padding tiles have no rows. None of them is sampled.
"""

from __future__ import annotations

import bisect
from typing import Callable, Protocol

import numpy as np
import torch

from firsttoken.attention.backend import write_block_tables
from firsttoken.attention.cuda_backend import CudaAttentionBackend, chunk_tile_array
from firsttoken.attention.staging import wait_for_copy
from firsttoken.attention.triton_kernels import TILE_FIELDS
from firsttoken.models.llama import LlamaForCausalLM
from firsttoken.worker.step_inputs import HostStep

Forward = Callable[[], torch.Tensor]

# Rows of the static scalar inputs.
_INPUT_IDS, _POSITIONS, _SLOTS, _SEQ_LENS = range(4)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """The ladder of captured batch sizes: 1, 2, 4, 8, 16, then every 16, ending at max_num_seqs."""
    sizes = [size for size in (1, 2, 4, 8, 16) if size < max_num_seqs]
    sizes += list(range(32, max_num_seqs, 16))
    return sizes + [max_num_seqs]


def graph_token_sizes(max_tokens: int) -> list[int]:
    """The ladder of captured token counts, ending at `max_tokens`: 16, 32, 48, 64, 96, 128, then
    every 64 up to 512, every 128 up to 1024, every 256 beyond. Steps finer than the compute's
    own granularity would add graphs without saving work; coarser ones would pad a 7B model's
    compute-bound prefill by more than an eighth."""
    sizes = [16, 32, 48, 64, 96] + list(range(128, 512, 64)) + list(range(512, 1024, 128))
    sizes += list(range(1024, max_tokens, 256))
    return [size for size in sizes if size < max_tokens] + [max_tokens]


def padded_size(count: int, sizes: list[int]) -> int | None:
    """The smallest captured size holding `count` rows or tokens; None when none is large enough."""
    index = bisect.bisect_left(sizes, count)
    return sizes[index] if index < len(sizes) else None


def max_chunk_tiles(num_tokens: int, max_num_seqs: int, tile_tokens: int) -> int:
    """Most chunk-kernel tiles `num_tokens` tokens of at most `max_num_seqs` sequences can need:
    each sequence's first tile, plus one per further `tile_tokens` of its tokens; never more
    than one per token."""
    return min(num_tokens, max_num_seqs + (num_tokens - 1) // tile_tokens)


def device_memory_in_use(device: torch.device) -> int:
    """Bytes in use on a CUDA device by every process (what a capture's pool adds to); 0 elsewhere."""
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return total - free


class StaticInputs:
    """Index arrays that captured graphs read: a pinned host mirror the step writes, and its
    device copy. Every copy is non-blocking; the mirror is written again only once the
    previous copy out of it is done."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], device: torch.device) -> None:
        pin = device.type != "cpu"
        self.host = {
            name: torch.zeros(shape, dtype=torch.int32, pin_memory=pin) for name, shape in shapes.items()
        }
        self.on_device = {name: torch.zeros_like(tensor, device=device) for name, tensor in self.host.items()}
        self._copy_done: torch.Event | None = None

    def writable(self) -> dict[str, np.ndarray]:
        """The host mirror as NumPy arrays, once the previous copy out of it is done."""
        wait_for_copy(self._copy_done)
        return {name: tensor.numpy() for name, tensor in self.host.items()}

    def ship(self, num_rows: dict[str, int]) -> None:
        """Copy the first `num_rows[name]` rows of each array to the device (all of those not named)."""
        for name, host in self.host.items():
            rows = num_rows.get(name, host.shape[0])
            self.on_device[name][:rows].copy_(host[:rows], non_blocking=True)
        device = next(iter(self.on_device.values())).device
        if device.type != "cpu":
            self._copy_done = torch.Event(device=device)
            self._copy_done.record()


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


def capture_ladder(
    capture: GraphCapture, sizes: list[int], forward_of: Callable[[int], Forward]
) -> dict[int, Forward]:
    """One replay per size, the largest captured first: smaller graphs then fit in the memory
    pool the largest one sized."""
    return {size: capture.capture(forward_of(size)) for size in reversed(sizes)}


class DecodeGraphs:
    """Owns the static decode inputs and one replay per batch size, each with its own output."""

    def __init__(
        self,
        model: LlamaForCausalLM,
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
        self.inputs = StaticInputs(
            {"scalars": (4, max_size), "block_tables": (max_size, max_blocks_per_seq)}, device
        )
        # Every row starts as padding, so the warm-up and capture runs touch only the scratch block.
        self._write_padding(self.inputs.writable(), 0, max_size)
        self.inputs.ship({})
        self.replays = capture_ladder(capture, sizes, lambda size: self._forward(model, size))

    def _forward(self, model: LlamaForCausalLM, size: int) -> Forward:
        input_ids, positions, slot_mapping, seq_lens = self.inputs.on_device["scalars"][:, :size]
        block_tables = self.inputs.on_device["block_tables"][:size]
        metadata = CudaAttentionBackend.decode_metadata(slot_mapping, block_tables, seq_lens)
        return lambda: model(input_ids, positions, metadata)

    def padded_size(self, step: HostStep) -> int | None:
        """The graph size that runs `step`; None if it must run eagerly."""
        if not step.is_decode_only:
            return None
        return padded_size(step.num_tokens, self.sizes)

    def run(self, step: HostStep, size: int) -> torch.Tensor:
        """Hidden states [num_decodes, hidden] of a decode-only step, from the graph of `size` rows."""
        num_rows = step.num_tokens
        arrays = self.inputs.writable()
        scalars = arrays["scalars"]
        scalars[_INPUT_IDS, :num_rows] = step.input_ids
        scalars[_POSITIONS, :num_rows] = step.positions
        scalars[_SLOTS, :num_rows] = step.slot_mapping
        scalars[_SEQ_LENS, :num_rows] = step.positions + 1
        write_block_tables(step.layout.sequences, self.block_size, arrays["block_tables"])
        self._write_padding(arrays, num_rows, size)
        self.inputs.ship({"block_tables": size})
        return self.replays[size]()[:num_rows]

    def _write_padding(self, arrays: dict[str, np.ndarray], start: int, end: int) -> None:
        scalars = arrays["scalars"]
        scalars[_INPUT_IDS, start:end] = 0
        scalars[_POSITIONS, start:end] = 0
        scalars[_SLOTS, start:end] = self.scratch_block_id * self.block_size
        scalars[_SEQ_LENS, start:end] = 1
        arrays["block_tables"][start:end, 0] = self.scratch_block_id


class StepGraphs:
    """Owns the static inputs of steps with prefill rows (token scalars, block tables, the chunk
    kernel's tile table) and one replay per token count, each with its own output."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        capture: GraphCapture,
        sizes: list[int],
        max_num_seqs: int,
        max_blocks_per_seq: int,
        tile_tokens: int,
        scratch_block_id: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.sizes = sizes
        self.max_num_seqs = max_num_seqs
        self.tile_tokens = tile_tokens
        self.scratch_block_id = scratch_block_id
        self.block_size = block_size
        max_tokens = sizes[-1]
        self.inputs = StaticInputs(
            {
                "scalars": (3, max_tokens),
                "block_tables": (max_num_seqs, max_blocks_per_seq),
                "tiles": (self._num_tiles(max_tokens), TILE_FIELDS),
            },
            device,
        )
        # All padding: the warm-up and capture runs write only the scratch block and attend to nothing.
        self._write_padding(self.inputs.writable(), 0, max_tokens)
        self.inputs.ship({})
        self.replays = capture_ladder(capture, sizes, lambda size: self._forward(model, size))

    def _num_tiles(self, num_tokens: int) -> int:
        return max_chunk_tiles(num_tokens, self.max_num_seqs, self.tile_tokens)

    def _forward(self, model: LlamaForCausalLM, size: int) -> Forward:
        input_ids, positions, slot_mapping = self.inputs.on_device["scalars"][:, :size]
        block_tables = self.inputs.on_device["block_tables"]
        tiles = self.inputs.on_device["tiles"][: self._num_tiles(size)]
        metadata = CudaAttentionBackend.chunk_metadata(slot_mapping, block_tables, tiles)
        return lambda: model(input_ids, positions, metadata)

    def padded_size(self, step: HostStep) -> int | None:
        """The graph size that runs `step`; None if it is decode-only or too long."""
        if step.is_decode_only or len(step.chunks) > self.max_num_seqs:
            return None
        return padded_size(step.num_tokens, self.sizes)

    def run(self, step: HostStep, size: int) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] of the step, from the graph of `size` tokens."""
        num_tokens = step.num_tokens
        arrays = self.inputs.writable()
        scalars = arrays["scalars"]
        scalars[_INPUT_IDS, :num_tokens] = step.input_ids
        scalars[_POSITIONS, :num_tokens] = step.positions
        scalars[_SLOTS, :num_tokens] = step.slot_mapping
        self._write_padding(arrays, num_tokens, size)
        write_block_tables(step.layout.sequences, self.block_size, arrays["block_tables"])
        tiles = chunk_tile_array(step.layout.query_rows(), self.tile_tokens)
        num_tiles = self._num_tiles(size)
        arrays["tiles"][: len(tiles)] = tiles
        arrays["tiles"][len(tiles) : num_tiles] = 0  # no rows: the kernel reads no key and writes nothing
        self.inputs.ship({"block_tables": len(step.layout.sequences), "tiles": num_tiles})
        return self.replays[size]()[:num_tokens]

    def _write_padding(self, arrays: dict[str, np.ndarray], start: int, end: int) -> None:
        scalars = arrays["scalars"]
        scalars[_INPUT_IDS, start:end] = 0
        scalars[_POSITIONS, start:end] = 0
        scalars[_SLOTS, start:end] = self.scratch_block_id * self.block_size
