"""Batch invariance on the CUDA path, bf16: a prompt's first-token logits are the same bits
alone, beside other prompts and decodes, in chunks, after a prefix-cache hit, and as a decode
recomputed as a prefill row (what a request preempted and recomputed goes through).

The runner drives the tiny model on the row-invariant Triton matmul, the Triton elementwise
ops and the attention backend as the worker builds it with `batch_invariant`, eagerly and with
its steps replayed from graphs (EagerCapture: decode-only steps padded to a batch size, steps
with prefill rows padded to a token count), against the prompt's logits alone in an eager step.
On a GPU the kernels run compiled; elsewhere under the Triton interpreter, whose dots sum each
row's products in K order (tests/cuda/triton_interpreter.py), so there these tests check the
kernels' structure (fixed tiles, key blocks and reduction order), and on a GPU the hardware too.
"""

from __future__ import annotations

import random

import pytest
import torch

from firsttoken.attention.cuda_backend import CudaAttentionBackend
from firsttoken.core.batch import SampleSpec, ScheduledChunk, SchedulerOutput
from firsttoken.ops import triton_ops
from firsttoken.ops.kernels import Kernels
from firsttoken.ops.linear import Linear, WidenedLinear
from firsttoken.ops.triton_matmul import RowInvariantLinear
from firsttoken.sample.sampler import Sampler
from firsttoken.sampling_params import SamplingParams
from firsttoken.worker.kv_cache import allocate_kv_caches
from firsttoken.worker.model_runner import ModelRunner
from firsttoken.worker.step_inputs import build_host_step, order_decodes_first
from tests.cuda.test_cuda_runner import EagerCapture
from tests.cuda.tiny_engine import TINY_ARCH, random_model
from tests.cuda.triton_interpreter import SLOW_ON_CPU

BLOCK_SIZE = 4
NUM_BLOCKS = 400
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPT = [(7 * i + 3) % TINY_ARCH.vocab_size for i in range(37)]


class InvariantRunner:
    """The runner as the worker builds it on CUDA with `batch_invariant`, the logits of each
    step's sampled rows kept, and fresh blocks handed out in order."""

    def __init__(self, device: torch.device, batch_invariant: bool = True, graphs: bool = False) -> None:
        backend = CudaAttentionBackend(
            device, TINY_ARCH.num_heads, TINY_ARCH.num_kv_heads,
            paged_prefills=batch_invariant, decodes_as_chunks=batch_invariant,
        )
        model = random_model(
            backend, torch.bfloat16, device, kernels=Kernels(fused=True, triton_ops=triton_ops)
        )
        model.prepare_projections(None, False, False, batch_invariant=batch_invariant, triton_matmuls=True)
        # One block past the manager's: the graphs' padding writes only there.
        model.bind_kv_caches(
            allocate_kv_caches(TINY_ARCH, NUM_BLOCKS + 1, BLOCK_SIZE, torch.bfloat16, device)
        )
        self.model = model
        self.runner = ModelRunner(
            model, backend, Sampler(0, device, TINY_ARCH.vocab_size), BLOCK_SIZE, device
        )
        self.capture = EagerCapture()
        if graphs:
            self.runner.capture_graphs(16, TINY_ARCH.max_position_embeddings, 256, NUM_BLOCKS, self.capture)
        compute_logits = model.compute_logits
        self.logits: torch.Tensor | None = None

        def keep_logits(hidden: torch.Tensor) -> torch.Tensor:
            self.logits = compute_logits(hidden)
            return self.logits

        model.compute_logits = keep_logits
        self.next_block = 0

    def blocks(self, num_tokens: int) -> list[int]:
        count = -(-num_tokens // BLOCK_SIZE)
        assert self.next_block + count <= NUM_BLOCKS
        self.next_block += count
        return list(range(self.next_block - count, self.next_block))

    def step(self, chunks: list[ScheduledChunk]) -> dict[str, torch.Tensor]:
        """Run one step: the logits [vocab] of each chunk that samples, and its token."""
        output = self.runner.execute(SchedulerOutput(chunks))
        sampling = [chunk.req_id for chunk in order_decodes_first(chunks) if chunk.sample is not None]
        assert sorted(output.sampled) == sorted(sampling)
        return {req_id: self.logits[row].clone() for row, req_id in enumerate(sampling)}


def _chunk(
    req_id: str,
    token_ids: list[int],
    start: int,
    block_table: list[int],
    sample: bool = True,
    prefill: bool = True,
) -> ScheduledChunk:
    spec = SampleSpec(GREEDY, 0, req_id) if sample else None
    return ScheduledChunk(req_id, token_ids, start, block_table, spec, prefill=prefill)


def _decode(req_id: str, token_ids: list[int], block_table: list[int]) -> ScheduledChunk:
    """The step that computes the last of `token_ids`, as a decode."""
    return _chunk(req_id, token_ids[-1:], len(token_ids) - 1, block_table, prefill=False)


def _prefill(runner: InvariantRunner, req_id: str, token_ids: list[int], chunk_size: int) -> torch.Tensor:
    """The first-token logits of `token_ids` prefilled alone in chunks of `chunk_size`."""
    table = runner.blocks(len(token_ids) + 1)
    for start in range(0, len(token_ids), chunk_size):
        end = min(start + chunk_size, len(token_ids))
        logits = runner.step(
            [_chunk(req_id, token_ids[start:end], start, table, sample=end == len(token_ids))]
        )
    return logits[req_id]


def _other_prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(TINY_ARCH.vocab_size) for _ in range(rng.randrange(1, 30))] for _ in range(count)]


# Under the interpreter the graph runs (their capture replays eager steps anyway) are the slow tier's.
@pytest.fixture(scope="module", params=["eager", pytest.param("graphs", marks=SLOW_ON_CPU)])
def invariant(request, device) -> InvariantRunner:
    return InvariantRunner(device, graphs=request.param == "graphs")


@pytest.fixture(scope="module")
def alone(device) -> torch.Tensor:
    """The prompt's first-token logits, alone in an eager step."""
    return _prefill(InvariantRunner(device), "alone", PROMPT, len(PROMPT))


def test_alone_the_logits_are_the_same_bits(invariant, alone):
    assert torch.equal(_prefill(invariant, "again", PROMPT, len(PROMPT)), alone)
    assert (invariant.capture.num_replays > 0) == (invariant.runner.step_graphs is not None)


# Under the interpreter one other prompt by default (3 take ~4 s, 15 ~10 s).
@pytest.mark.parametrize("num_others", [1, *(pytest.param(count, marks=SLOW_ON_CPU) for count in (3, 7, 15))])
def test_beside_other_prompts_and_decodes_the_logits_are_the_same_bits(invariant, alone, num_others):
    others = _other_prompts(num_others, seed=num_others)
    decoding = others[: num_others // 2]  # these run their first decode beside the prompt
    tables = {f"other-{i}": invariant.blocks(len(prompt) + 2) for i, prompt in enumerate(others)}
    if decoding:
        invariant.step(
            [_chunk(f"other-{i}", prompt, 0, tables[f"other-{i}"]) for i, prompt in enumerate(decoding)]
        )
    chunks = [_chunk("target", PROMPT, 0, invariant.blocks(len(PROMPT)))]
    for i, prompt in enumerate(others):
        if i < len(decoding):
            chunks.append(_decode(f"other-{i}", prompt + [5], tables[f"other-{i}"]))
        else:
            chunks.append(_chunk(f"other-{i}", prompt, 0, tables[f"other-{i}"]))
    random.Random(num_others).shuffle(chunks)  # the target at another row of the step each time
    assert torch.equal(invariant.step(chunks)["target"], alone)


@pytest.mark.parametrize("chunk_size", [5, pytest.param(16, marks=SLOW_ON_CPU)])
def test_in_chunks_the_logits_are_the_same_bits(invariant, alone, chunk_size):
    assert torch.equal(_prefill(invariant, f"chunked-{chunk_size}", PROMPT, chunk_size), alone)


def test_after_a_prefix_cache_hit_the_logits_are_the_same_bits(invariant, alone):
    """Another prompt with the same first 24 tokens filled 6 blocks; the target's chunk starts on them."""
    cached = 24
    table = invariant.blocks(len(PROMPT))
    writer_table = table[: cached // BLOCK_SIZE] + invariant.blocks(3)
    invariant.step([_chunk("writer", PROMPT[:cached] + [1, 2, 3], 0, writer_table)])
    hit = invariant.step([_chunk("hit", PROMPT[cached:], cached, table)])["hit"]
    assert torch.equal(hit, alone)


def test_a_decode_row_is_the_bits_of_the_same_token_recomputed_as_a_prefill_row(invariant, alone):
    """A preempted request prefills again the tokens it had decoded: its logits after each must
    be the ones its decode steps saw. Decodes run beside another request's decode."""
    token_ids = list(PROMPT)
    table = invariant.blocks(len(PROMPT) + 4)
    neighbour = _other_prompts(1, seed=99)[0]
    neighbour_table = invariant.blocks(len(neighbour) + 4)
    step = invariant.step(
        [_chunk("decoding", token_ids, 0, table), _chunk("neighbour", neighbour, 0, neighbour_table)]
    )
    decoded = []
    replays = invariant.capture.num_replays
    for _ in range(3):
        token_ids.append(int(step["decoding"].argmax()))
        neighbour.append(7)
        step = invariant.step(
            [_decode("decoding", token_ids, table), _decode("neighbour", neighbour, neighbour_table)]
        )
        decoded.append(step["decoding"])
    assert invariant.capture.num_replays - replays == (3 if invariant.runner.decode_graphs is not None else 0)
    recomputed = _prefill(invariant, "recomputed", token_ids, len(token_ids))
    assert torch.equal(recomputed, decoded[-1])
    assert torch.equal(_prefill(invariant, "recomputed-in-chunks", token_ids[:-1], 11), decoded[-2])


def test_every_projection_runs_on_the_row_invariant_matmul(invariant):
    assert not any(isinstance(module, Linear) for module in invariant.model.modules())
    assert isinstance(invariant.model.lm_head, RowInvariantLinear)


def test_without_batch_invariance_the_old_kernels_run(device):
    plain = InvariantRunner(device, batch_invariant=False)
    assert not any(isinstance(module, RowInvariantLinear) for module in plain.model.modules())
    # cuBLAS's plain Linear on a GPU; under the interpreter on a CPU without bf16 matmul kernels,
    # the CPU's own form of a plain bf16 projection (float32 sums).
    assert isinstance(plain.model.lm_head, (Linear, WidenedLinear))
    backend = plain.runner.backend
    assert not backend.rows_invariant
    layout_step = [_chunk("fresh", PROMPT, 0, plain.blocks(len(PROMPT)))]
    step = build_host_step(layout_step, BLOCK_SIZE)
    metadata = backend.build_metadata(step.layout, torch.from_numpy(step.slot_mapping).to(device))
    assert metadata.chunks is None and [prefill.num_tokens for prefill in metadata.fresh_prefills] == [
        len(PROMPT)
    ]
