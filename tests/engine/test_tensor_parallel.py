"""Tensor parallelism on the CPU (gloo): two ranks give one rank's tokens on the embedded model,
whose 9 query and 3 KV heads split unevenly (6 + 3 query heads, 2 + 1 KV heads).

One TP=2 engine serves the module (its start spawns a process that imports torch and loads the
model: seconds), with chunked prefill, the prefix cache and n-gram speculation on: each changes
how the steps run, never which tokens come. float32 against the session's float32 engine (one
rank, no speculation), so that the all-reduce's other summation order stays far below what
could flip a greedy token.
"""

from __future__ import annotations

import argparse

import pytest

from firsttoken import LLM, SamplingParams
from firsttoken.config import EngineConfig
from firsttoken.engine_args import add_engine_args, engine_kwargs
from firsttoken.errors import InvalidInputError
from tests.prompts import SHORT_PROMPTS, long_prompt

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)
LOGPROB_TOLERANCE = 1e-4
NGRAM = {"method": "ngram", "num_speculative_tokens": 4}


@pytest.fixture(scope="module")
def tp2(model_path):
    # Chunks of 64: the longer prompts prefill in several steps here, in one step in the reference.
    llm = LLM(
        model_path,
        dtype="float32",
        kv_cache_memory_bytes=128 << 20,
        chunk_size=64,
        tensor_parallel_size=2,
        speculative_config=NGRAM,
    )
    yield llm
    llm.shutdown()


def assert_same_outputs(outputs, expected) -> None:
    """Same greedy tokens, and every token's log-prob within LOGPROB_TOLERANCE."""
    for output, reference in zip(outputs, expected, strict=True):
        assert output.token_ids == reference.token_ids
        for token, reference_token in zip(output.logprobs, reference.logprobs, strict=True):
            assert abs(token.logprob - reference_token.logprob) < LOGPROB_TOLERANCE


def test_two_ranks_give_one_ranks_greedy_tokens_on_the_parity_prompts_batched(tp2, llm):
    assert_same_outputs(tp2.generate(SHORT_PROMPTS, GREEDY), llm.generate(SHORT_PROMPTS, GREEDY))
    stats = tp2.stats()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks


def test_two_ranks_inspect_as_one_engine_and_refuse_reaching_one_shard(tp2, llm):
    inspection = tp2.inspect()
    assert inspection.tensor_parallel_size == 2 and "2 tensor-parallel ranks" in inspection.description
    assert inspection.num_layers == llm.inspect().num_layers
    with pytest.raises(InvalidInputError, match="tensor_parallel_size: must be 1"):
        tp2.core.single_rank_model()


def test_two_ranks_reuse_the_prefix_cache_with_the_same_tokens(tp2, llm):
    shared = llm.tokenizer.encode(long_prompt(1))
    prompts = [shared + llm.tokenizer.encode(suffix) for suffix in (" First,", " Second,", " In short,")]
    expected = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    (first,) = tp2.generate(prompt_token_ids=prompts[:1], sampling_params=GREEDY)
    hits_before = tp2.stats().prefix_cache_hits
    rest = tp2.generate(prompt_token_ids=prompts[1:], sampling_params=GREEDY)
    num_shared_block_tokens = len(shared) // 16 * 16
    assert tp2.stats().prefix_cache_hits - hits_before >= 2 * num_shared_block_tokens
    assert_same_outputs([first, *rest], expected)


def test_first_token_logprobs_match_within_1e_4(tp2, llm):
    first = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    for output, reference in zip(
        tp2.generate(SHORT_PROMPTS, first), llm.generate(SHORT_PROMPTS, first), strict=True
    ):
        token, reference_token = output.logprobs[0], reference.logprobs[0]
        assert token.token_id == reference_token.token_id
        assert abs(token.logprob - reference_token.logprob) < LOGPROB_TOLERANCE
        for top, reference_top in zip(token.top_logprobs, reference_token.top_logprobs, strict=True):
            assert top.token_id == reference_top.token_id
            assert abs(top.logprob - reference_top.logprob) < LOGPROB_TOLERANCE


@pytest.mark.slow  # speculation and two ranks each run by default; together, in the slow tier
def test_speculation_on_two_ranks_verifies_proposals_into_one_ranks_tokens(tp2, llm):
    prompts = ["Repeat this list exactly three times: apple, banana, cherry, date, elderberry, fig, grape."]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=0)
    drafts_before = tp2.stats().spec_decode_num_drafts
    outputs = tp2.generate(prompts, params)
    assert tp2.stats().spec_decode_num_drafts > drafts_before
    assert_same_outputs(outputs, llm.generate(prompts, params))


def test_one_rank_starts_no_process_group(llm):
    executor = llm.core.executor
    assert executor.rank_group is None and executor.rank_processes is None
    assert executor.worker.model.collectives is None and executor.worker.runner.sampler is not None


def test_tensor_parallel_size_is_an_engine_option_and_a_flag():
    assert EngineConfig.from_kwargs(tensor_parallel_size=2).parallel.tensor_parallel_size == 2
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    options = engine_kwargs(
        parser.parse_args(["--tensor-parallel-size", "2", "--distributed-backend", "hccl"])
    )
    assert options == {"tensor_parallel_size": 2, "distributed_backend": "hccl"}
    with pytest.raises(InvalidInputError, match="tensor_parallel_size: must be >= 1"):
        EngineConfig.from_kwargs(tensor_parallel_size=0)
