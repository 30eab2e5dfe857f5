"""Greedy output that does not depend on the batch, in bf16 and in float32: alone, beside other
requests, in chunks of any size (one token included), after a prefix-cache hit, after
preemption and recompute, and on blocks a decode step wrote: the same tokens and the same
logprob bits. Each dtype runs where the engine claims it; float32 prefills keep their bits on
the row-invariant native matmul wherever it is built.

The engine's steps are what vary here, not the model: the sweeps run on a random-weight model of
the embedded model's shapes with 2 layers (the same kernels, a fifth of the step time); the
embedded model's own first tokens keep their bits beside others at the end."""

from __future__ import annotations

import random

import pytest
import torch

from firsttoken import LLM, SamplingParams
from firsttoken.ops.decode_batch_linear import DecodeBatchLinear
from firsttoken.ops.linear import NativeRowInvariantLinear
from firsttoken.ops.native_abi import LEVELS_MAX_ROWS
from tests.conftest import FIXED_THREADS, may_claim_batch_invariance

PROMPTS = [
    "Explain why the sky is blue, and why sunsets over the sea turn red and orange in the evening.",
    "Write a haiku about autumn leaves falling on a quiet river, then explain the image it draws.",
    "What is 17 times 23? Show each step of the multiplication, then check it by division.",
    "List three uses of copper in houses, then say which of them matters most and why it does.",
]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)


def _other_prompts(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    words = ["cat", "river", "moon", "quantum", "bread", "system", "galaxy", "tea", "seven", "blue"]
    return [" ".join(rng.choice(words) for _ in range(rng.randrange(3, 200))) for _ in range(count)]


def _bits(output) -> tuple:
    return tuple(output.token_ids), tuple(
        (entry.logprob, tuple((alt.token_id, alt.logprob) for alt in entry.top_logprobs))
        for entry in output.logprobs
    )


_NEEDS = {
    "bfloat16": "AVX512-BF16 native kernels and row-invariant oneDNN, which AMX's is not",
    "float32": "native kernels, and decode rows attending with the prefill kernel's arithmetic",
}


@pytest.fixture(scope="module", params=["bfloat16", "float32"])
def engine_options(request, two_layer_model_path):
    """A fixed chunk size and thread count: the claim holds for any, and these start without
    measuring the step cost. A CPU without bf16 instructions never claims bf16 invariance:
    skipped before an engine starts to say so."""
    if not may_claim_batch_invariance(request.param):
        pytest.skip(f"no bfloat16 batch invariance on this machine (needs {_NEEDS['bfloat16']})")
    return dict(
        model=two_layer_model_path, dtype=request.param, kv_cache_memory_bytes=256 << 20, chunk_size=512,
        batch_invariant=True, **FIXED_THREADS,
    )


@pytest.fixture(scope="module")
def invariant_llm(engine_options, engine_for):
    llm = engine_for(**engine_options, enable_prompt_cache=False)
    if not llm.core.worker.batch_invariant:
        dtype = engine_options["dtype"]
        pytest.skip(f"no {dtype} batch invariance on this machine (needs {_NEEDS[dtype]})")
    return llm


@pytest.fixture(scope="module")
def alone(invariant_llm):
    return [_bits(invariant_llm.generate([prompt], GREEDY)[0]) for prompt in PROMPTS]


@pytest.mark.parametrize("num_others", [1, 3, 7, 15])
def test_beside_other_requests_every_bit_is_the_same(invariant_llm, alone, num_others):
    outputs = invariant_llm.generate(PROMPTS + _other_prompts(num_others, seed=num_others), GREEDY)
    assert [_bits(output) for output in outputs[: len(PROMPTS)]] == alone


@pytest.mark.parametrize("chunk_size", [1, 7, 16, 64])
def test_in_chunks_of_any_size_every_bit_is_the_same(engine_options, alone, chunk_size):
    """A one-token prompt chunk (every chunk at size 1) runs on the prefill kernel, not as a
    decode."""
    llm = LLM(**{**engine_options, "chunk_size": chunk_size}, enable_prompt_cache=False)
    assert [_bits(llm.generate([prompt], GREEDY)[0]) for prompt in PROMPTS] == alone


def test_after_a_prefix_cache_hit_every_bit_is_the_same(engine_options, alone):
    llm = LLM(**engine_options, enable_prompt_cache=True)
    block_size = llm.core.config.cache.block_size
    for prompt, expected in zip(PROMPTS, alone):
        llm.generate([prompt + " Answer briefly."], GREEDY)  # caches the prompt's full blocks
        hit = llm.generate([prompt], GREEDY)[0]
        assert hit.num_cached_tokens == len(llm.tokenizer.encode(prompt)) // block_size * block_size
        assert _bits(hit) == expected


@pytest.mark.parametrize("extra_tokens", [0, 1])
def test_a_hit_on_whole_blocks_recomputes_the_last_token_as_a_prefill(
    invariant_llm, engine_options, extra_tokens
):
    """A prompt of whole cached blocks recomputes only its last token (to sample from it), and
    one block and a token leaves one new token: either way a one-token prefill chunk."""
    block_size = invariant_llm.core.config.cache.block_size
    token_ids = invariant_llm.tokenizer.encode(" ".join(PROMPTS))[: 2 * block_size + extra_tokens]
    expected = _bits(invariant_llm.generate(prompt_token_ids=[token_ids], sampling_params=GREEDY)[0])
    llm = LLM(**engine_options, enable_prompt_cache=True)
    llm.generate(prompt_token_ids=[token_ids + [11, 12, 13]], sampling_params=GREEDY)
    hit = llm.generate(prompt_token_ids=[token_ids], sampling_params=GREEDY)[0]
    assert hit.num_cached_tokens >= block_size
    assert _bits(hit) == expected


def test_without_it_one_row_steps_take_onednn_one_row_kernel(engine_options):
    llm = LLM(**{**engine_options, "batch_invariant": False}, enable_prompt_cache=False)
    assert not llm.core.worker.batch_invariant
    modules = list(llm.core.worker.model.modules())
    assert not any(getattr(module, "pad_single_rows", False) for module in modules)
    # The native row matmul only inside a DecodeBatchLinear: for the step sizes it was measured
    # faster at (float32), never as every projection's kernel.
    routed = {id(module.native_linear) for module in modules if isinstance(module, DecodeBatchLinear)}
    assert all(id(module) in routed for module in modules if isinstance(module, NativeRowInvariantLinear))


def test_an_engine_of_kernels_already_probed_claims_without_probing_again(engine_options, monkeypatch):
    """The oneDNN probe answers once per kernel choice in a process: a second engine of the
    same shapes and threads claims what the first did, without running it."""
    from firsttoken.worker import batch_invariance

    monkeypatch.setattr(batch_invariance, "_ROWS_INVARIANT_BY_KERNEL_CHOICE", {})
    probed = []
    probe = batch_invariance.rows_invariant

    def counted_probe(module) -> bool:
        probed.append(module)
        return probe(module)

    monkeypatch.setattr(batch_invariance, "rows_invariant", counted_probe)
    first = LLM(**engine_options, enable_prompt_cache=False)
    if engine_options["dtype"] == "bfloat16":
        assert probed, "the first engine of these shapes runs the probe"
    probed.clear()
    second = LLM(**engine_options, enable_prompt_cache=True)
    assert second.core.worker.batch_invariant == first.core.worker.batch_invariant
    assert probed == []


def test_quantized_weights_claim_no_invariance(engine_options):
    """Decode steps read the quantized weights and prefills the float ones: a position's bits
    depend on which computed it."""
    llm = LLM(**{**engine_options, "chunk_size": 64}, enable_prompt_cache=False, quantization="int8")
    assert not llm.core.worker.batch_invariant


def test_seeded_sampling_draws_the_same_tokens_beside_other_requests(invariant_llm):
    seeded = [
        SamplingParams(
            temperature=0.9, top_p=0.95, top_k=50, seed=40 + i, max_tokens=24, ignore_eos=True, logprobs=1
        )
        for i in range(len(PROMPTS))
    ]
    alone = [_bits(invariant_llm.generate([prompt], params)[0]) for prompt, params in zip(PROMPTS, seeded)]
    others = _other_prompts(7, seed=99)
    unseeded = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)
    outputs = invariant_llm.generate(PROMPTS + others, seeded + [unseeded] * len(others))
    assert [_bits(output) for output in outputs[: len(PROMPTS)]] == alone


def test_after_preemption_and_recompute_every_bit_is_the_same(invariant_llm, engine_options, alone):
    """A preempted request prefills again the tokens it had decoded: decode rows attend with
    the prefill kernel's arithmetic, so the recomputed K/V and logits are the decoded ones."""
    others = _other_prompts(6, seed=7)
    others_alone = [_bits(invariant_llm.generate([prompt], GREEDY)[0]) for prompt in others]
    element_bytes = 2 if engine_options["dtype"] == "bfloat16" else 4
    num_layers = invariant_llm.core.worker.checkpoint.arch.num_layers
    # K and V x layers x block tokens x KV heads x dims
    block_bytes = 2 * num_layers * 16 * 3 * 64 * element_bytes
    small = LLM(**{**engine_options, "kv_cache_memory_bytes": 48 * block_bytes}, enable_prompt_cache=False,
                max_num_seqs=10)
    outputs = small.generate(others + PROMPTS, GREEDY)
    assert sum(output.metrics.num_preemptions for output in outputs) > 0
    assert [_bits(output) for output in outputs] == others_alone + alone


def test_a_prompt_on_blocks_a_decode_step_wrote_gets_every_bit_of_a_cold_prefill(
    invariant_llm, engine_options
):
    """A follow-up prompt that repeats an answer hits the blocks its decode steps wrote."""
    llm = LLM(**engine_options, enable_prompt_cache=True)
    prompt_ids = llm.tokenizer.encode(PROMPTS[0])
    answer = llm.generate(prompt_token_ids=[prompt_ids], sampling_params=GREEDY)[0]
    follow_up = prompt_ids + answer.token_ids + llm.tokenizer.encode(" Say it again.")
    hit = llm.generate(prompt_token_ids=[follow_up], sampling_params=GREEDY)[0]
    block_size = llm.core.config.cache.block_size
    assert hit.num_cached_tokens > len(prompt_ids) // block_size * block_size  # decode-written blocks too
    cold = invariant_llm.generate(prompt_token_ids=[follow_up], sampling_params=GREEDY)[0]
    assert _bits(hit) == _bits(cold)


@pytest.fixture(scope="module")
def float32_llm(engine_for):
    """A float32 engine with its projections on the row-invariant native matmul, whether or not
    its decode rows attend invariantly (the whole claim)."""
    llm = engine_for(
        dtype="float32", kv_cache_memory_bytes=256 << 20, chunk_size=512, enable_prompt_cache=False,
        batch_invariant=True,
    )
    if llm.core.worker.kernels.native is None:
        pytest.skip("no native kernels on this machine (no working C compiler)")
    return llm


def test_float32_projections_run_on_the_row_invariant_matmul(float32_llm):
    """Every projection and the LM head; with native kernels decode rows attend with the prefill
    arithmetic on every ISA too, so the engine claims the whole guarantee."""
    worker = float32_llm.core.worker
    model = worker.model
    projections = [model.lm_head]
    for layer in model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        projections += [attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj]
    assert all(isinstance(module, NativeRowInvariantLinear) for module in projections)
    # The file's Q4_1 projections and Q8_0 embedding (the tied head): decode steps read levels.
    assert [module.levels.bits for module in projections] == [8] + [4] * (len(projections) - 1)
    block_size, head_dim = float32_llm.core.config.cache.block_size, worker.checkpoint.arch.head_dim
    assert worker.runner.backend.decodes_as_prefill(block_size, torch.float32, head_dim)
    assert worker.batch_invariant


def test_float32_decode_steps_on_levels_give_the_bits_of_a_prefill(float32_llm):
    """Decode steps read the projections' levels, prefills their floats: a decoded token's
    logprobs are the bits it gets when its context is prefilled again."""
    prompt_ids = float32_llm.tokenizer.encode(PROMPTS[2])
    decoded = float32_llm.generate(prompt_token_ids=[prompt_ids], sampling_params=GREEDY)[0]
    for length in (1, 12, len(decoded.token_ids)):
        context = prompt_ids + decoded.token_ids[: length - 1]
        assert len(context) > LEVELS_MAX_ROWS  # a prefill on the floats
        next_one = SamplingParams(temperature=0, max_tokens=1, logprobs=2)
        recomputed = float32_llm.generate(prompt_token_ids=[context], sampling_params=next_one)[0]
        token_bits, logprob_bits = _bits(recomputed)
        assert token_bits == tuple(decoded.token_ids[length - 1 : length])
        assert logprob_bits == _bits(decoded)[1][length - 1 : length]


# On the embedded model (all 30 layers): the smallest and a large case by default, the others slow.
@pytest.mark.parametrize(
    "num_others", [1, pytest.param(3, marks=pytest.mark.slow), 7, pytest.param(15, marks=pytest.mark.slow)]
)
def test_float32_first_tokens_beside_other_requests_keep_every_bit(float32_llm, num_others):
    """A prompt's prefill beside others' (torch's float32 matmul gave 0 of 16 the same bits)."""
    first = SamplingParams(temperature=0, max_tokens=1, logprobs=2)
    alone = [_bits(float32_llm.generate([prompt], first)[0]) for prompt in PROMPTS]
    outputs = float32_llm.generate(PROMPTS + _other_prompts(num_others, seed=num_others), first)
    assert [_bits(output) for output in outputs[: len(PROMPTS)]] == alone
