"""The runner chooses the whole-step native decode for the steps it serves (decode-only, at
most DECODE_MAX_ROWS rows) and the model's forward for every other step; the whole-step W8A8
forward serves every step.

The native step itself needs AVX512-BF16 (tests/ops/test_native_decode.py runs it where it
can); here a stand-in runs the model's per-op forward in its place, so the choice is checked
on any CPU."""

from __future__ import annotations

import torch

from firsttoken.attention.backend import BatchLayout, SequenceLayout
from firsttoken.attention.cpu_backend import CPUAttentionBackend
from firsttoken.ops.native_abi import DECODE_MAX_ROWS
from firsttoken.sample.sampler import Sampler
from firsttoken.worker.kv_cache import allocate_kv_caches
from firsttoken.worker.model_runner import ModelRunner
from firsttoken.worker.whole_step_decode import WholeStepDecode
from firsttoken.worker.whole_step_w8a8 import WholeStepW8A8, prefill_chunks
from tests.cuda.tiny_engine import TINY_ARCH, greedy_generate, random_model

BLOCK_SIZE = 4
NUM_BLOCKS = 80
DEVICE = torch.device("cpu")
PROMPTS = [[5], list(range(10, 17)), list(range(30, 53)), list(range(100, 140))]


class RecordingBackend(CPUAttentionBackend):
    """Records the layout of every step it builds metadata for."""

    def __init__(self) -> None:
        super().__init__(DEVICE)
        self.layouts: list[BatchLayout] = []

    def build_metadata(self, layout, slot_mapping):
        self.layouts.append(layout)
        return super().build_metadata(layout, slot_mapping)


class PerOpStandIn:
    """Stands in for a native whole step: the model's per-op forward, on a backend of its own
    (the step it stands for decides which steps it takes)."""

    def __init__(self, model) -> None:
        self.model = model
        self.backend = RecordingBackend()

    def run(self, input_ids, positions, slot_mapping, layout):
        return self.model(input_ids, positions, self.backend.build_metadata(layout, slot_mapping))


class PerOpWholeStep(PerOpStandIn, WholeStepDecode):
    """The whole-step int4 decode's stand-in."""


def _runner() -> tuple[ModelRunner, RecordingBackend]:
    backend = RecordingBackend()
    model = random_model(backend, torch.float32, DEVICE)
    model.bind_kv_caches(allocate_kv_caches(TINY_ARCH, NUM_BLOCKS, BLOCK_SIZE, torch.float32, DEVICE))
    sampler = Sampler(0, DEVICE, TINY_ARCH.vocab_size)
    return ModelRunner(model, backend, sampler, BLOCK_SIZE, DEVICE), backend


def _is_decode_only(layout: BatchLayout) -> bool:
    return layout.num_decodes == len(layout.sequences)


def test_the_runner_takes_the_whole_step_decode_for_decode_only_steps():
    plain, _ = _runner()
    assert plain.whole_step_decode is None  # no native int4 projections in a float32 model
    expected = greedy_generate(plain, PROMPTS, 6, NUM_BLOCKS, BLOCK_SIZE, chunk_size=16)

    runner, backend = _runner()
    whole_step = PerOpWholeStep(runner.model)
    runner.whole_step_decode = whole_step
    assert greedy_generate(runner, PROMPTS, 6, NUM_BLOCKS, BLOCK_SIZE, chunk_size=16) == expected
    served, forwarded = whole_step.backend.layouts, backend.layouts
    assert served and all(_is_decode_only(layout) for layout in served)
    assert forwarded and not any(_is_decode_only(layout) for layout in forwarded)


def test_the_whole_step_decode_serves_at_most_its_rows_of_decodes_only():
    def decode(block_id: int) -> SequenceLayout:
        return SequenceLayout(query_len=1, num_context_tokens=5, block_table=[block_id, block_id + 1])

    decodes = [decode(2 * row) for row in range(DECODE_MAX_ROWS + 1)]
    prefill = SequenceLayout(query_len=3, num_context_tokens=0, block_table=[40])
    assert WholeStepDecode.takes(BatchLayout(decodes[:1], 1, BLOCK_SIZE))
    assert WholeStepDecode.takes(BatchLayout(decodes[:DECODE_MAX_ROWS], DECODE_MAX_ROWS, BLOCK_SIZE))
    assert not WholeStepDecode.takes(BatchLayout(decodes, DECODE_MAX_ROWS + 1, BLOCK_SIZE))
    assert not WholeStepDecode.takes(BatchLayout(decodes[:2] + [prefill], 2, BLOCK_SIZE))
    assert not WholeStepDecode.takes(BatchLayout([prefill], 0, BLOCK_SIZE))


class PerOpWholeStepW8A8(PerOpStandIn, WholeStepW8A8):
    """The whole-step W8A8 forward's stand-in."""


def test_the_runner_takes_the_whole_step_w8a8_for_every_step():
    plain, _ = _runner()
    assert plain.whole_step_w8a8 is None  # no W8A8 projections in a float32 model
    expected = greedy_generate(plain, PROMPTS, 6, NUM_BLOCKS, BLOCK_SIZE, chunk_size=16)

    runner, backend = _runner()
    whole_step = PerOpWholeStepW8A8(runner.model)
    runner.whole_step_w8a8 = whole_step
    assert greedy_generate(runner, PROMPTS, 6, NUM_BLOCKS, BLOCK_SIZE, chunk_size=16) == expected
    served = whole_step.backend.layouts
    assert any(_is_decode_only(layout) for layout in served)
    assert any(layout.num_decodes == 0 for layout in served)
    assert not backend.layouts  # the model's forward ran for no step


def test_the_whole_step_w8a8_serves_every_step_and_finds_each_chunks_keys():
    fresh = SequenceLayout(query_len=6, num_context_tokens=0, block_table=[9, 3])
    in_place = SequenceLayout(query_len=5, num_context_tokens=7, block_table=[20, 21, 22, 8])
    scattered = SequenceLayout(query_len=5, num_context_tokens=7, block_table=[20, 22, 23])
    decode = SequenceLayout(query_len=1, num_context_tokens=5, block_table=[30, 31])
    for sequences, num_decodes in (([fresh], 0), ([decode], 1), ([decode, in_place, scattered], 1)):
        assert WholeStepW8A8.takes(BatchLayout(sequences, num_decodes, BLOCK_SIZE))
    assert not WholeStepW8A8.takes(BatchLayout([], 0, BLOCK_SIZE))
    # Rows after the decode rows, in batch order; each sequence's blocks up to its length (block 8
    # lies past the 12 tokens of in_place), the first key's slot where they are a run.
    chunks = prefill_chunks(BatchLayout([decode, fresh, in_place, scattered], 1, BLOCK_SIZE))
    rows = [(chunk.first_row, chunk.num_rows, chunk.num_context_tokens) for chunk in chunks]
    assert rows == [(1, 6, 0), (7, 5, 7), (12, 5, 7)]
    assert [chunk.block_ids for chunk in chunks] == [[9, 3], [20, 21, 22], [20, 22, 23]]
    assert [chunk.first_slot for chunk in chunks] == [-1, 20 * BLOCK_SIZE, -1]
