"""Chunked prefill gives the same greedy tokens whatever the chunk size, cache hits or not (on a
random-weight model of the embedded model's shapes with 2 layers: the same kernels, a fifth of
the step time)."""

from __future__ import annotations

import pytest

from firsttoken import LLM, SamplingParams
from tests.conftest import FIXED_THREADS
from tests.prompts import long_prompt

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _prompts(llm: LLM) -> list[list[int]]:
    story = llm.tokenizer.encode(long_prompt(2))  # ~170 tokens: many chunks of 7, 16, 64
    return [story[:150], story[:150] + llm.tokenizer.encode(" And then?"), story[:97]]


def _run(model_path, **options) -> list[list[int]]:
    llm = LLM(model_path, dtype="float32", kv_cache_memory_bytes=64 << 20, **FIXED_THREADS, **options)
    outputs = []
    for prompt in _prompts(llm):  # one at a time: later prompts hit the earlier ones' blocks
        (output,) = llm.generate(prompt_token_ids=[prompt], sampling_params=GREEDY)
        outputs.append(output.token_ids)
    if options.get("enable_prompt_cache", True):
        assert llm.stats().prefix_cache_hits > 0
    return outputs


@pytest.fixture(scope="module")
def unchunked(two_layer_model_path):
    return _run(two_layer_model_path, enable_chunked_prefill=False, enable_prompt_cache=False)


# Every chunk size with and without the prompt cache, but for unchunked without the cache: the
# baseline itself. Each case starts an engine (a second or less on two layers).
CASES = [
    pytest.param(chunk_size, cache, id=f"{chunk_size}-{'cache' if cache else 'no-cache'}")
    for chunk_size in (1, 7, 16, 64, 512, "auto", None)
    for cache in (False, True)
    if chunk_size is not None or cache
]


@pytest.mark.parametrize("chunk_size,cache", CASES)
def test_same_tokens_for_every_chunk_size(two_layer_model_path, unchunked, chunk_size, cache):
    options = dict(enable_prompt_cache=cache)
    if chunk_size is None:
        options["enable_chunked_prefill"] = False
    else:
        options["chunk_size"] = chunk_size
    assert _run(two_layer_model_path, **options) == unchunked
