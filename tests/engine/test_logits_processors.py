"""Logits processors through the engine: bad words never appear, min_tokens holds the end back,
logit_bias forces a token, penalties change the output; the token state follows chunked prefill,
prefix-cache hits and preemption (the same tokens as without them) and is freed when a request
ends, finished or aborted."""

from __future__ import annotations

import pytest

from firsttoken import LLM, SamplingParams
from tests.conftest import FIXED_THREADS
from tests.engine_state import tracked_requests

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
# Each over one KV block of 16 tokens, so that a second run hits the prefix cache.
PROMPTS = [
    "Tell me a story about a dragon who lived in a cave beside the sea and loved to read old books",
    "Hello there, my friend. It has been a long time since we last met at the market in town",
    "The history of Rome is long and full of wars, emperors, senators and the rise of a great empire",
    "List three fruits that grow on trees in warm countries and say which one you like the best",
]


def test_a_bad_word_never_appears(llm):
    plain = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=24))
    assert "Paris" in plain.text
    banned = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=24, bad_words=["Paris"]))
    assert "Paris" not in banned.text
    for word_token_ids in llm.tokenizer.encode_bad_words(["Paris"]):
        length = len(word_token_ids)
        windows = [tuple(banned.token_ids[i : i + length]) for i in range(len(banned.token_ids))]
        assert word_token_ids not in windows
    assert tracked_requests(llm) == {}


def test_min_tokens_holds_back_the_end(llm):
    plain = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=40))
    assert plain.finish_reason == "stop" and len(plain.token_ids) < 12
    held = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=40, min_tokens=20))
    assert len(held.token_ids) >= 20
    assert not set(held.token_ids[:20]) & llm.tokenizer.eos_token_ids
    assert held.text.startswith(plain.text)


def test_min_tokens_holds_back_stop_token_ids(llm):
    plain = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=12))
    stop_id = plain.token_ids[2]
    (stopped,) = llm.generate(
        [llm.tokenizer.apply_chat_template(CHAT)],
        SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_id]),
    )
    assert stopped.token_ids == plain.token_ids[:3] and stopped.finish_reason == "stop"
    held = llm.chat(
        CHAT, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_id], min_tokens=4)
    )
    assert stop_id not in held.token_ids[:4]


def test_a_forcing_logit_bias_takes_every_token(llm):
    token_id = llm.tokenizer.encode(" banana", add_special_tokens=False)[0]
    (output,) = llm.generate(
        ["Hello"], SamplingParams(temperature=0.9, seed=1, max_tokens=6, logit_bias={token_id: 100})
    )
    assert output.token_ids == [token_id] * 6


# Each penalty reaches the engine by default in tests/server/test_sampling_api.py; here one is
# checked for reproducibility by default, the others in the slow tier.
@pytest.mark.parametrize(
    "penalty",
    [
        dict(repetition_penalty=1.3),
        pytest.param(dict(frequency_penalty=1.0), marks=pytest.mark.slow),
        pytest.param(dict(presence_penalty=1.5), marks=pytest.mark.slow),
    ],
)
def test_penalties_change_a_seeded_output_reproducibly(llm, penalty):
    (plain,) = llm.generate(["Hello"], SamplingParams(temperature=0.8, seed=3, max_tokens=24))
    penalized = SamplingParams(temperature=0.8, seed=3, max_tokens=24, **penalty)
    (first,) = llm.generate(["Hello"], penalized)
    (again,) = llm.generate(["Hello"], penalized)
    assert first.token_ids == again.token_ids
    assert first.token_ids != plain.token_ids


MIXED = [
    SamplingParams(temperature=0, max_tokens=20, repetition_penalty=1.3, ignore_eos=True),
    SamplingParams(
        temperature=0, max_tokens=20, frequency_penalty=0.8, presence_penalty=0.5, ignore_eos=True
    ),
    SamplingParams(temperature=0.7, seed=5, max_tokens=20, bad_words=["the", "a"], min_tokens=20),
    SamplingParams(temperature=0, max_tokens=20, logit_bias={11: 5.0}, min_p=0.1, ignore_eos=True),
]


def test_chunking_and_preemption_give_the_same_processed_tokens(engine_for, two_layer_model_path):
    """On the 2-layer model of the embedded model's shapes: the processors' state across chunks
    and recomputes is the engine's logic, not the model's."""
    llm = engine_for(
        model=two_layer_model_path, dtype="float32", chunk_size=512, kv_cache_memory_bytes=64 << 20
    )
    expected = [output.token_ids for output in llm.generate(PROMPTS, MIXED)]
    # Chunks of 8 tokens and a KV cache of 7 blocks of 16 tokens: the four requests (3 blocks
    # each at the end) cannot all hold their blocks, so the newest are preempted and recomputed.
    worker = llm.core.worker
    block_bytes = (
        sum(cache.numel() * cache.element_size() for cache in worker.kv_caches) // worker.num_kv_blocks
    )
    small = LLM(
        two_layer_model_path,
        dtype="float32",
        chunk_size=8,
        block_size=16,
        kv_cache_memory_bytes=7 * block_bytes,
        **FIXED_THREADS,
    )
    assert small.core.worker.num_kv_blocks == 7
    assert [output.token_ids for output in small.generate(PROMPTS, MIXED)] == expected
    assert small.stats().num_preemptions > 0
    # Again, now on the prefixes the first run cached.
    assert [output.token_ids for output in small.generate(PROMPTS, MIXED)] == expected
    assert small.stats().prefix_cache_hits > 0
    assert tracked_requests(small) == {}


def test_an_aborted_request_frees_its_token_state(llm):
    stream = llm.stream("Hello", SamplingParams(max_tokens=50, frequency_penalty=1.0, ignore_eos=True))
    next(stream)
    assert len(tracked_requests(llm)) == 1
    stream.close()
    assert tracked_requests(llm) == {}
