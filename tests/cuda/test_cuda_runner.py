"""The runner on the CUDA path (pinned staging, Triton attention and elementwise ops, padded
decode and step graphs) gives the plain path's greedy tokens; padding writes only the scratch block.

Both run on the GPU where there is one (the Triton kernels compiled), else on the CPU through
the interpreter. Graph capture is replaced by eager replays of the same static-buffer forward
(EagerCapture), which exercises the ladders, the static inputs and the padding; the CUDA
capture itself is covered by tests/cuda/test_gpu.py on a GPU.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from firsttoken.attention.cuda_backend import CudaAttentionBackend
from firsttoken.attention.cpu_backend import CPUAttentionBackend
from firsttoken.core.batch import SampleSpec, ScheduledChunk, SchedulerOutput
from firsttoken.models.arch import ModelArch
from firsttoken.models.llama import every_layer_is_plain
from firsttoken.ops import triton_ops
from firsttoken.ops.kernels import Kernels
from firsttoken.sample.sampler import Sampler
from firsttoken.sampling_params import SamplingParams
from firsttoken.worker.cuda_graphs import Forward
from firsttoken.worker.kv_cache import allocate_kv_caches
from firsttoken.worker.model_runner import ModelRunner
from tests.cuda.tiny_engine import TINY_ARCH, greedy_generate, random_model
from tests.cuda.triton_interpreter import SLOW_ON_CPU

BLOCK_SIZE = 4
NUM_BLOCKS = 80
PROMPTS = [
    [5],  # a one-token prompt
    list(range(10, 17)),
    list(range(30, 53)),
    list(range(30, 53)) + [7, 8, 9, 11, 12],  # shares 5 full blocks with the previous prompt
    list(range(100, 140)),  # chunked: 40 tokens in chunks of 16
]


class EagerCapture:
    """Stands in for graph capture on the CPU: a replay reruns the static-buffer forward."""

    def __init__(self) -> None:
        self.num_replays = 0

    def capture(self, forward: Forward) -> Forward:
        def replay() -> torch.Tensor:
            self.num_replays += 1
            return forward()

        return replay


def _runners(device, dtype, arch: ModelArch = TINY_ARCH):
    reference_model = random_model(CPUAttentionBackend(device), dtype, device, arch=arch)
    # As the worker builds it on CUDA: the Triton kernels of the elementwise ops, and prompts
    # paged through the Triton kernel where a layer has a window or soft-cap.
    backend = CudaAttentionBackend(
        device,
        arch.num_heads,
        arch.num_kv_heads,
        paged_prefills=not every_layer_is_plain(arch, arch.max_position_embeddings, None, 0),
    )
    kernels = Kernels(fused=True, triton_ops=triton_ops)
    model = random_model(backend, dtype, device, kernels=kernels, arch=arch)
    reference_caches = allocate_kv_caches(arch, NUM_BLOCKS + 1, BLOCK_SIZE, dtype, device)
    caches = allocate_kv_caches(arch, NUM_BLOCKS + 1, BLOCK_SIZE, dtype, device)
    reference_model.bind_kv_caches(reference_caches)
    model.bind_kv_caches(caches)
    reference_sampler = Sampler(0, device, TINY_ARCH.vocab_size)
    reference = ModelRunner(
        reference_model, CPUAttentionBackend(device), reference_sampler, BLOCK_SIZE, device
    )
    runner = ModelRunner(model, backend, Sampler(0, device, TINY_ARCH.vocab_size), BLOCK_SIZE, device)
    return reference, reference_caches, runner, caches


# Each case takes the interpreter ~3-25 s: there the default run keeps mixed graphs, whose steps
# past 16 tokens run eagerly, as every step does with no graphs.
@pytest.mark.parametrize(
    "max_graph_tokens",
    [
        pytest.param(None, marks=SLOW_ON_CPU), pytest.param(0, marks=SLOW_ON_CPU), 16,
        pytest.param(64, marks=SLOW_ON_CPU),
    ],
)
def test_cuda_runner_gives_the_cpu_paths_greedy_tokens(max_graph_tokens, device):
    """None: no graphs; 0: decode graphs only; 16: steps up to 16 tokens replayed, longer ones
    eager; 64: every step replayed (the scheduler's steps hold at most 64 tokens)."""
    reference, reference_caches, runner, caches = _runners(device, torch.float32)
    capture = EagerCapture()
    use_graphs = max_graph_tokens is not None
    if use_graphs:
        runner.capture_graphs(
            max_num_seqs=8, max_model_len=512, max_graph_tokens=max_graph_tokens,
            scratch_block_id=NUM_BLOCKS, capture=capture,
        )
    step_replays = _count_step_replays(runner)
    expected = greedy_generate(reference, PROMPTS, 6, NUM_BLOCKS, BLOCK_SIZE, chunk_size=16)
    generated = greedy_generate(runner, PROMPTS, 6, NUM_BLOCKS, BLOCK_SIZE, chunk_size=16)
    assert generated == expected
    assert (capture.num_replays > 0) == use_graphs
    assert (step_replays() > 0) == bool(max_graph_tokens)
    for cache, reference_cache in zip(caches, reference_caches):
        # Every real block holds the same K/V; padding rows wrote only the scratch block.
        torch.testing.assert_close(
            cache[:, :NUM_BLOCKS], reference_cache[:, :NUM_BLOCKS], atol=1e-4, rtol=1e-4
        )
        assert bool(cache[:, NUM_BLOCKS].abs().sum() > 0) == use_graphs


def test_a_decode_batch_pads_to_the_next_captured_size_and_writes_only_its_slots(device):
    _, _, runner, caches = _runners(device, torch.float32)
    capture = EagerCapture()
    report = runner.capture_graphs(
        max_num_seqs=8, max_model_len=512, max_graph_tokens=0, scratch_block_id=NUM_BLOCKS, capture=capture
    )
    assert runner.decode_graphs.sizes == [1, 2, 4, 8] and report.batch_sizes == (1, 2, 4, 8)
    assert runner.step_graphs is None and report.token_sizes == ()
    assert report.seconds > 0
    if device.type == "cpu":
        assert report.device_memory_bytes == 0
    greedy = SamplingParams(temperature=0, max_tokens=4)
    positions = [0, 3, 4, 9, 17]  # 5 decodes: padded to 8
    chunks = [
        ScheduledChunk(
            f"req-{row}",
            [7 + row],
            position,
            [10 * row + b for b in range(position // BLOCK_SIZE + 1)],
            SampleSpec(greedy, 0, f"req-{row}"),
        )
        for row, position in enumerate(positions)
    ]
    output = runner.execute(SchedulerOutput(chunks))

    assert capture.num_replays == 1 and sorted(output.sampled) == [chunk.req_id for chunk in chunks]
    scalars = runner.decode_graphs.inputs.host["scalars"]
    assert scalars[:, 5:8].tolist() == [[0] * 3, [0] * 3, [NUM_BLOCKS * BLOCK_SIZE] * 3, [1] * 3]
    assert runner.decode_graphs.inputs.host["block_tables"][5:8, 0].tolist() == [NUM_BLOCKS] * 3
    assert scalars[3, :5].tolist() == [position + 1 for position in positions]
    real_slots = {
        chunk.block_table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
        for chunk, p in zip(chunks, positions)
    }
    for cache in caches:
        written = cache[0].reshape(NUM_BLOCKS + 1, BLOCK_SIZE, -1).abs().sum(-1).flatten().nonzero().flatten()
        assert set(written.tolist()) == real_slots | {NUM_BLOCKS * BLOCK_SIZE}


# Gemma 2's differences on the tiny model: a local layer (window 12, shorter than four prompts)
# before a global one, and soft-capped scores; then a window on every layer, whose blocks
# before the window go back to the pool as a sequence advances.
WINDOWED_ARCHS = {
    "local-global-softcap": dataclasses.replace(
        TINY_ARCH, sliding_window=12, sliding_window_layers=(0,), attention_logit_softcap=3.0
    ),
    "every-layer-windowed": dataclasses.replace(TINY_ARCH, sliding_window=12),
}


# Under the interpreter a window on every layer is the slow tier's (the mixed case has a window too).
@pytest.mark.parametrize(
    "name", ["local-global-softcap", pytest.param("every-layer-windowed", marks=SLOW_ON_CPU)]
)
def test_windowed_and_soft_capped_layers_give_the_cpu_paths_greedy_tokens(name, device):
    """Prompts past the window, chunked, a prefix-cache hit, decode graphs replayed."""
    arch = WINDOWED_ARCHS[name]
    reference, _, runner, _ = _runners(device, torch.float32, arch)
    runner.capture_graphs(
        max_num_seqs=8, max_model_len=512, max_graph_tokens=0,
        scratch_block_id=NUM_BLOCKS, capture=EagerCapture(),
    )  # fmt: skip
    expected = greedy_generate(reference, PROMPTS, 6, NUM_BLOCKS, BLOCK_SIZE, chunk_size=16)
    assert greedy_generate(runner, PROMPTS, 6, NUM_BLOCKS, BLOCK_SIZE, chunk_size=16) == expected
    # The window changes the tokens: a kernel attending over every key would not pass.
    unwindowed, _, _, _ = _runners(device, torch.float32, TINY_ARCH)
    assert greedy_generate(unwindowed, PROMPTS, 6, NUM_BLOCKS, BLOCK_SIZE, chunk_size=16) != expected


def _count_step_replays(runner: ModelRunner):
    """A function returning how many steps the runner's step graphs have run so far."""
    if runner.step_graphs is None:
        return lambda: 0
    calls = []
    run = runner.step_graphs.run

    def counting_run(step, size):
        calls.append(size)
        return run(step, size)

    runner.step_graphs.run = counting_run
    return lambda: len(calls)


def test_a_mixed_step_pads_to_the_next_token_count_and_writes_only_its_slots(device):
    """Two decodes, a fresh prompt and a chunk on cached context: 2 + 9 + 6 = 17 tokens run in
    the 32-token graph; the 15 padding tokens write only the scratch block, padding tiles are empty."""
    reference, reference_caches, runner, caches = _runners(device, torch.float32)
    capture = EagerCapture()
    report = runner.capture_graphs(
        max_num_seqs=8, max_model_len=512, max_graph_tokens=64, scratch_block_id=NUM_BLOCKS, capture=capture
    )
    assert report.token_sizes == (16, 32, 48, 64) and runner.step_graphs.sizes == [16, 32, 48, 64]
    greedy = SamplingParams(temperature=0, max_tokens=4)
    # Context of the decodes and of the chunk, written by an eager step of both runners first.
    context = [
        ScheduledChunk("decode-a", list(range(20, 25)), 0, [3, 4], None),
        ScheduledChunk("decode-b", [40, 41], 0, [9], None),
        ScheduledChunk("chunk", list(range(60, 70)), 0, [12, 13, 14], None),
    ]
    mixed = [
        ScheduledChunk("decode-a", [25], 5, [3, 4], SampleSpec(greedy, 0, "decode-a")),
        ScheduledChunk("prompt", list(range(80, 89)), 0, [20, 21, 22], SampleSpec(greedy, 0, "prompt")),
        ScheduledChunk("decode-b", [42], 2, [9], SampleSpec(greedy, 0, "decode-b")),
        ScheduledChunk("chunk", list(range(70, 76)), 10, [12, 13, 14, 15], SampleSpec(greedy, 0, "chunk")),
    ]
    for step_runner in (reference, runner):
        step_runner.execute(SchedulerOutput(context))
    assert capture.num_replays == 1  # 17 context tokens, fresh prompts: the 32-token graph
    capture.num_replays = 0
    expected = reference.execute(SchedulerOutput(mixed))
    output = runner.execute(SchedulerOutput(mixed))
    assert capture.num_replays == 1
    assert output.sampled == expected.sampled

    scalars = runner.step_graphs.inputs.host["scalars"]
    assert scalars[:2, 17:32].tolist() == [[0] * 15, [0] * 15]
    assert scalars[2, 17:32].tolist() == [NUM_BLOCKS * BLOCK_SIZE] * 15
    # Decodes first, then the prompt in one tile, then the chunk; empty tiles up to the bound.
    tiles = runner.step_graphs.inputs.host["tiles"]
    assert tiles[:4].tolist() == [[0, 0, 5, 1], [1, 1, 2, 1], [2, 2, 0, 9], [3, 11, 10, 6]]
    assert tiles[4:].abs().sum() == 0
    for cache, reference_cache in zip(caches, reference_caches):
        torch.testing.assert_close(
            cache[:, :NUM_BLOCKS], reference_cache[:, :NUM_BLOCKS], atol=1e-5, rtol=1e-5
        )
        written = cache[0, NUM_BLOCKS].abs().sum((-2, -1)).nonzero().flatten()
        assert written.tolist() == [0]  # every padding token at the scratch block's first slot
