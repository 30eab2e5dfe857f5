"""bf16 greedy output that does not depend on the batch: alone, beside other requests, in
chunks of other sizes, and after a prefix-cache hit, the same tokens and the same logprob bits.

Not yet covered: a prefill chunk of a single token (a 1-token tail, or the one token a
whole-block cache hit leaves) runs on the decode attention kernel, whose softmax sums in
another order than the prefill kernel's key tiles; likewise a preempted request's recompute.
The tests below choose lengths that leave no such chunk, and check that they do."""

from __future__ import annotations

import random

import pytest

from firsttoken import LLM, SamplingParams

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
        (entry.logprob, tuple((alt.token_id, alt.logprob) for alt in entry.top_logprobs)) for entry in output.logprobs
    )


@pytest.fixture(scope="module")
def engine_options(model_path):
    return dict(model=model_path, dtype="bfloat16", kv_cache_memory_bytes=256 << 20)


@pytest.fixture(scope="module")
def invariant_llm(engine_options):
    llm = LLM(**engine_options, enable_prompt_cache=False)
    if not llm.engine.worker.batch_invariant:
        pytest.skip("no batch invariance on this machine (needs AVX512-BF16 native kernels and row-invariant oneDNN)")
    return llm


@pytest.fixture(scope="module")
def alone(invariant_llm):
    return [_bits(invariant_llm.generate([prompt], GREEDY)[0]) for prompt in PROMPTS]


@pytest.mark.parametrize("num_others", [1, 3, 7, 15])
def test_beside_other_requests_every_bit_is_the_same(invariant_llm, alone, num_others):
    outputs = invariant_llm.generate(PROMPTS + _other_prompts(num_others, seed=num_others), GREEDY)
    assert [_bits(output) for output in outputs[: len(PROMPTS)]] == alone


@pytest.mark.parametrize("chunk_size", [5, 16, 64])
def test_in_chunks_of_other_sizes_every_bit_is_the_same(engine_options, alone, chunk_size):
    llm = LLM(**engine_options, enable_prompt_cache=False, chunk_size=chunk_size)
    lengths = [len(llm.tokenizer.encode(prompt)) for prompt in PROMPTS]
    assert all(1 < length and length % chunk_size != 1 for length in lengths), lengths  # no 1-token chunk
    assert [_bits(llm.generate([prompt], GREEDY)[0]) for prompt in PROMPTS] == alone


def test_after_a_prefix_cache_hit_every_bit_is_the_same(engine_options, alone):
    llm = LLM(**engine_options, enable_prompt_cache=True)
    block_size = llm.engine.config.cache.block_size
    for prompt, expected in zip(PROMPTS, alone):
        length = len(llm.tokenizer.encode(prompt))
        assert length > block_size and length % block_size > 1, length  # a hit that leaves 2+ tokens
        llm.generate([prompt + " Answer briefly."], GREEDY)  # caches the prompt's full blocks
        hit = llm.generate([prompt], GREEDY)[0]
        assert hit.num_cached_tokens == length // block_size * block_size
        assert _bits(hit) == expected


def test_without_it_one_row_steps_take_onednn_one_row_kernel(engine_options):
    llm = LLM(**engine_options, enable_prompt_cache=False, batch_invariant=False)
    assert not llm.engine.worker.batch_invariant
    assert not any(getattr(module, "pad_single_rows", False) for module in llm.engine.worker.model.modules())
