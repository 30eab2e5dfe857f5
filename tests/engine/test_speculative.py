"""Speculative decoding (n-gram prompt lookup) changes how fast tokens come, never which:
greedy and seeded outputs with it equal those without, bit for bit in bf16."""

from __future__ import annotations

import argparse

import pytest

from firsttoken import LLM, SamplingParams
from firsttoken.engine_args import add_engine_args, engine_kwargs
from firsttoken.errors import InvalidInputError
from tests.conftest import FIXED_THREADS, may_claim_batch_invariance
from tests.engine_state import all_blocks_free

# Prompts whose answers repeat what came before (the second's does), so that proposals get accepted.
PROMPTS = [
    "Repeat this list exactly three times: apple, banana, cherry, date, elderberry, fig, grape.",
    "Write a Python function that adds two numbers, then write the same function again with comments.",
    "What is the capital of France?",
]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def _bits(output) -> tuple:
    logprobs = tuple(entry.logprob for entry in output.logprobs) if output.logprobs else None
    return tuple(output.token_ids), output.text, output.finish_reason, logprobs


def _tokens(output) -> tuple:
    return tuple(output.token_ids), output.text, output.finish_reason


@pytest.fixture(scope="module")
def engines(model_path):
    """Engines with batch invariance (bf16 where the CPU has bf16 kernels, else float32 on the
    native kernels): verify rows give the bits decode rows give."""
    for dtype in filter(may_claim_batch_invariance, ("bfloat16", "float32")):
        options = {"model": model_path, "dtype": dtype, "kv_cache_memory_bytes": 128 << 20, "chunk_size": 256,
                   "batch_invariant": True, **FIXED_THREADS}
        plain = LLM(**options)
        if plain.core.worker.batch_invariant:
            return plain, LLM(**options, speculative_config=NGRAM)
    pytest.skip("no batch invariance on this machine: verify rows may round otherwise than decode rows")


def _options_of(engine: LLM) -> dict:
    """The options the module's engines share, for engines of a test's own."""
    return {"model": engine.config.model_config.model, "dtype": engine.config.model_config.dtype,
            "kv_cache_memory_bytes": 128 << 20, "chunk_size": 256, "batch_invariant": True, **FIXED_THREADS}


def _block_bytes(engine: LLM, num_layers: int = 30) -> int:
    element_bytes = 2 if engine.config.model_config.dtype == "bfloat16" else 4
    # K and V x layers x block tokens x KV heads x head size
    return 2 * num_layers * 16 * 3 * 64 * element_bytes


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=1),
        # Seeded draws are the target's, seed for seed, by default below.
        pytest.param(
            SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=40, ignore_eos=True),
            marks=pytest.mark.slow,
        ),
        SamplingParams(temperature=0, max_tokens=40, stop=[", fig", "b + a"]),
    ],
    ids=["greedy", "seeded", "stop-strings"],
)
def test_outputs_equal_those_without_speculation_alone_and_batched(engines, params):
    plain, speculative = engines
    expected = [_bits(output) for output in plain.generate(PROMPTS, params)]
    assert [_bits(speculative.generate([prompt], params)[0]) for prompt in PROMPTS] == expected
    assert [_bits(output) for output in speculative.generate(PROMPTS, params)] == expected
    assert all_blocks_free(speculative)


@pytest.mark.slow
def test_float32_greedy_tokens_equal_those_without_speculation(model_path):
    """Without batch invariance a verify row may round otherwise than a decode row: the tokens
    stay the greedy ones, the logprobs within float32 noise."""
    options = {"model": model_path, "dtype": "float32", "kv_cache_memory_bytes": 128 << 20, "chunk_size": 256,
               **FIXED_THREADS}
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=1)
    expected = LLM(**options).generate(PROMPTS, params)
    outputs = LLM(**options, speculative_config=NGRAM).generate(PROMPTS, params)
    assert [_tokens(output) for output in outputs] == [_tokens(output) for output in expected]
    for output, reference in zip(outputs, expected):
        assert [entry.logprob for entry in output.logprobs] == pytest.approx(
            [entry.logprob for entry in reference.logprobs], abs=1e-4
        )


def test_proposals_get_accepted_and_counted(engines):
    _, speculative = engines
    before = speculative.stats()
    speculative.generate(PROMPTS[1:2], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    after = speculative.stats()
    proposed = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    accepted = after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    assert proposed > 0 and 0 < accepted <= proposed
    assert after.spec_decode_accepted_per_position[0] >= after.spec_decode_accepted_per_position[-1]
    # Fewer steps than tokens: some steps emitted several.
    assert after.num_steps - before.num_steps < 40


def test_the_prompt_cache_serves_blocks_of_accepted_tokens_only(engines):
    """A follow-up repeating the answer hits its blocks; their KV gives the plain engine's answer."""
    plain, speculative = engines
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    prompt_ids = speculative.tokenizer.encode(PROMPTS[1])
    answer = speculative.generate(prompt_token_ids=[prompt_ids], sampling_params=params)[0]
    follow_up = prompt_ids + answer.token_ids + speculative.tokenizer.encode(" Once more:")
    hit = speculative.generate(prompt_token_ids=[follow_up], sampling_params=params)[0]
    assert hit.num_cached_tokens > len(prompt_ids)
    cold = plain.generate(prompt_token_ids=[follow_up], sampling_params=params)[0]
    assert hit.token_ids == cold.token_ids


def test_bad_speculative_options_name_the_field(model_path):
    with pytest.raises(InvalidInputError, match="method"):
        LLM(model_path, speculative_config={"method": "medusa"})
    with pytest.raises(InvalidInputError, match="speculative_config.*prompt_lookup_mid"):
        LLM(model_path, speculative_config={"method": "ngram", "prompt_lookup_mid": 3})
    with pytest.raises(InvalidInputError, match="prompt_lookup_min"):
        LLM(
            model_path, speculative_config={"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 3}
        )


def test_the_command_line_takes_vllms_json_and_flags_over_it():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}',
                              "--prompt-lookup-max", "5"])
    options = engine_kwargs(args)
    assert options["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 3}
    assert options["prompt_lookup_max"] == 5
    with pytest.raises(SystemExit):
        parser.parse_args(["--speculative-config", "[1, 2]"])


def test_beside_non_speculating_requests_in_chunks_and_across_preemption(engines, model_path):
    """Speculating requests batched with one the sampler tracks (no proposals for it), on a KV
    cache small enough to preempt, with small prefill chunks: every output as without."""
    plain, _ = engines
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    penalized = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, repetition_penalty=1.3)
    prompts = PROMPTS + [PROMPTS[1]]
    params = [greedy] * len(PROMPTS) + [penalized]
    expected = [_bits(output) for output in plain.generate(prompts, params)]
    options = {**_options_of(plain), "kv_cache_memory_bytes": 14 * _block_bytes(plain), "chunk_size": 16}
    small = LLM(**options, speculative_config=NGRAM)
    outputs = small.generate(prompts, params)
    assert [_bits(output) for output in outputs] == expected
    stats = small.stats()
    assert stats.num_preemptions > 0 and stats.spec_decode_num_draft_tokens > 0
    assert all_blocks_free(small)


def test_sampled_tokens_are_the_targets_draws_seed_for_seed(engines):
    """At temperature 1 every position draws from the target's own distribution with its own
    seeded uniform, proposals or not: the same token for each of 48 seeds, so the accepted
    tokens' frequencies are the target's."""
    plain, speculative = engines
    params = [
        SamplingParams(temperature=1.0, seed=seed, max_tokens=12, ignore_eos=True) for seed in range(48)
    ]
    prompt = [PROMPTS[1]] * len(params)
    before = speculative.stats().spec_decode_num_draft_tokens
    group = 8  # the default max_num_speculating_seqs
    outputs = [
        output for start in range(0, len(params), group)
        for output in speculative.generate(prompt[start : start + group], params[start : start + group])
    ]
    assert speculative.stats().spec_decode_num_draft_tokens > before
    assert [output.token_ids for output in outputs] == [
        output.token_ids for output in plain.generate(prompt, params)
    ]


@pytest.mark.slow  # a second engine as the draft; drafts and their acceptance are checked by default
def test_a_draft_model_drafting_for_itself_is_always_right_and_changes_nothing(engines, model_path):
    """The embedded model as its own draft: every proposal accepted, the same bits as without,
    and both engines' blocks all back in their pools."""
    plain, _ = engines
    options = _options_of(plain)
    drafted = LLM(
        **options, speculative_config={"method": "draft", "model": model_path, "num_speculative_tokens": 3}
    )
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
    assert [_bits(output) for output in drafted.generate(PROMPTS, greedy)] == [
        _bits(output) for output in plain.generate(PROMPTS, greedy)
    ]
    stats = drafted.stats()
    assert stats.spec_decode_num_draft_tokens > 0
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens  # greedy agrees
    assert len(stats.spec_decode_accepted_per_position) <= 3
    # Sampled, the target rejects some greedy proposals; its draws stay its own.
    seeded = SamplingParams(temperature=0.8, seed=5, max_tokens=24, ignore_eos=True, stop=["b):"])
    assert [_bits(output) for output in drafted.generate(PROMPTS, seeded)] == [
        _bits(output) for output in plain.generate(PROMPTS, seeded)
    ]
    assert all_blocks_free(drafted)
    draft_core = drafted.core.proposer.core
    assert draft_core.kv_manager.pool.num_free_blocks == draft_core.kv_manager.num_blocks


def test_a_sequence_longer_than_the_drafts_cache_decodes_without_proposals(engines, two_layer_model_path):
    """The draft, a two-layer random-weight model of the embedded model's shapes (its proposals
    mostly rejected), holds two blocks: past them the target decodes alone, with its own tokens."""
    plain, _ = engines
    options = _options_of(plain)
    drafted = LLM(**options, speculative_config={
        "method": "draft", "model": two_layer_model_path,
        "draft_kv_cache_memory_bytes": 2 * _block_bytes(plain, num_layers=2),
    })
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outputs = drafted.generate(PROMPTS, params)
    assert [output.token_ids for output in outputs] == [
        output.token_ids for output in plain.generate(PROMPTS, params)
    ]
    assert all_blocks_free(drafted)


def test_a_draft_model_is_named_with_method_draft_only(model_path):
    with pytest.raises(InvalidInputError, match="model"):
        LLM(model_path, speculative_config={"method": "draft"})
    with pytest.raises(InvalidInputError, match="model"):
        LLM(model_path, speculative_config={"method": "ngram", "model": model_path})
