"""The runner on the CUDA path (pinned staging, Triton attention and elementwise ops, padded
decode graphs) gives the plain path's greedy tokens; padding rows write only the scratch block.

Both run on the GPU where there is one (the Triton kernels compiled), else on the CPU through
the interpreter. Graph capture is replaced by eager replays of the same static-buffer forward
(EagerCapture), which exercises the ladder, the static inputs and the padding rows; the CUDA
capture itself is covered by tests/cuda/test_gpu.py on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from firsttoken.attention.cuda_backend import CudaAttentionBackend
from firsttoken.attention.sdpa import SDPABackend
from firsttoken.core.batch import SampleSpec, ScheduledChunk, SchedulerOutput
from firsttoken.ops import triton_ops
from firsttoken.ops.kernels import Kernels
from firsttoken.sample.sampler import Sampler
from firsttoken.sampling_params import SamplingParams
from firsttoken.worker.cuda_graphs import Forward
from firsttoken.worker.kv_cache import allocate_kv_caches
from firsttoken.worker.model_runner import ModelRunner
from tests.cuda.tiny_engine import TINY_ARCH, greedy_generate, random_model

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


def _runners(device, dtype):
    reference_model = random_model(SDPABackend(device), dtype, device)
    backend = CudaAttentionBackend(device, TINY_ARCH.num_heads, TINY_ARCH.num_kv_heads)
    # As the worker builds it on CUDA: the Triton kernels of the elementwise ops.
    model = random_model(backend, dtype, device, kernels=Kernels(fused=True, triton_ops=triton_ops))
    reference_caches = allocate_kv_caches(TINY_ARCH, NUM_BLOCKS + 1, BLOCK_SIZE, dtype, device)
    caches = allocate_kv_caches(TINY_ARCH, NUM_BLOCKS + 1, BLOCK_SIZE, dtype, device)
    reference_model.bind_kv_caches(reference_caches)
    model.bind_kv_caches(caches)
    reference_sampler = Sampler(0, device, TINY_ARCH.vocab_size)
    reference = ModelRunner(reference_model, SDPABackend(device), reference_sampler, BLOCK_SIZE, device)
    runner = ModelRunner(model, backend, Sampler(0, device, TINY_ARCH.vocab_size), BLOCK_SIZE, device)
    return reference, reference_caches, runner, caches


@pytest.mark.parametrize("use_graphs", [True, False])
def test_cuda_runner_gives_the_cpu_paths_greedy_tokens(use_graphs, device):
    reference, reference_caches, runner, caches = _runners(device, torch.float32)
    capture = EagerCapture()
    if use_graphs:
        runner.capture_decode_graphs(max_num_seqs=8, max_model_len=512, scratch_block_id=NUM_BLOCKS, capture=capture)
    expected = greedy_generate(reference, PROMPTS, 6, NUM_BLOCKS, BLOCK_SIZE, chunk_size=16)
    generated = greedy_generate(runner, PROMPTS, 6, NUM_BLOCKS, BLOCK_SIZE, chunk_size=16)
    assert generated == expected
    assert (capture.num_replays > 0) == use_graphs
    for cache, reference_cache in zip(caches, reference_caches):
        # Every real block holds the same K/V; padding rows wrote only the scratch block.
        torch.testing.assert_close(
            cache[:, :NUM_BLOCKS], reference_cache[:, :NUM_BLOCKS], atol=1e-4, rtol=1e-4
        )
        assert bool(cache[:, NUM_BLOCKS].abs().sum() > 0) == use_graphs


def test_a_decode_batch_pads_to_the_next_captured_size_and_writes_only_its_slots(device):
    _, _, runner, caches = _runners(device, torch.float32)
    capture = EagerCapture()
    report = runner.capture_decode_graphs(
        max_num_seqs=8, max_model_len=512, scratch_block_id=NUM_BLOCKS, capture=capture
    )
    assert runner.graphs.sizes == [1, 2, 4, 8] and report.batch_sizes == (1, 2, 4, 8)
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
    scalars = runner.graphs.host_scalars
    assert scalars[:, 5:8].tolist() == [[0] * 3, [0] * 3, [NUM_BLOCKS * BLOCK_SIZE] * 3, [1] * 3]
    assert runner.graphs.host_tables[5:8, 0].tolist() == [NUM_BLOCKS] * 3
    assert scalars[3, :5].tolist() == [position + 1 for position in positions]
    real_slots = {
        chunk.block_table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
        for chunk, p in zip(chunks, positions)
    }
    for cache in caches:
        written = cache[0].reshape(NUM_BLOCKS + 1, BLOCK_SIZE, -1).abs().sum(-1).flatten().nonzero().flatten()
        assert set(written.tolist()) == real_slots | {NUM_BLOCKS * BLOCK_SIZE}
