"""Prompt cache: same tokens with it on and off, real reuse, pins, persistence, reset. Tests of
what it reuses and computes run on a random-weight model of the embedded model's shapes with 2
layers (the same kernels, a fifth of the step time)."""

from __future__ import annotations

import os

import pytest

from firsttoken import LLM, SamplingParams
from tests.conftest import FIXED_THREADS
from tests.engine_state import all_blocks_free
from tests.prompts import long_prompt

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SYSTEM_PROMPTS = [
    "You are a pirate. Answer every question in pirate speech, briefly.",
    "You are a careful math tutor who explains each step of a calculation clearly and checks the result.",
    long_prompt(3),
]
QUESTIONS = ["What is 2+2?", "Name a color.", "Why is the sky blue?", "Tell me a joke.", "Hi"]


def _engine(model_path, **options) -> LLM:
    # max_model_len: pins must leave a request of that length room beside them.
    settings = dict(
        dtype="float32", kv_cache_memory_bytes=128 << 20, chunk_size=256, max_model_len=1024, **FIXED_THREADS
    )
    settings.update(options)
    return LLM(model_path, **settings)


def _workload(llm: LLM) -> list[list[list[int]]]:
    """Rounds of prompts sharing system prompts (ending mid-block and on block edges),
    with exact duplicates of earlier prompts."""
    conversations = [
        [{"role": "system", "content": system}, {"role": "user", "content": question}]
        for system in SYSTEM_PROMPTS
        for question in QUESTIONS
    ]
    prompts = [llm.tokenizer.encode(llm.tokenizer.apply_chat_template(c)) for c in conversations]
    block_aligned = prompts[0][: 4 * llm.config.cache.block_size] + [504, 3575]
    return [
        prompts[:6],
        prompts[3:12] + [block_aligned],
        prompts[:4] + prompts[10:] + [block_aligned, prompts[0]],
    ]


@pytest.fixture(scope="module")
def uncached_outputs(two_layer_model_path):
    llm = _engine(two_layer_model_path, enable_prompt_cache=False)
    return [
        [o.token_ids for o in llm.generate(prompt_token_ids=batch, sampling_params=GREEDY)]
        for batch in _workload(llm)
    ]


def test_same_tokens_with_the_cache_on_and_off(two_layer_model_path, uncached_outputs):
    llm = _engine(two_layer_model_path)
    cached_tokens = []
    for batch, expected in zip(_workload(llm), uncached_outputs):
        outputs = llm.generate(prompt_token_ids=batch, sampling_params=GREEDY)
        assert [o.token_ids for o in outputs] == expected
        cached_tokens += [o.num_cached_tokens for o in outputs]
    stats = llm.stats()
    assert sum(cached_tokens) == stats.prefix_cache_hits > 0
    assert stats.prefix_cache_queries > stats.prefix_cache_hits
    assert all_blocks_free(llm)


def test_shared_512_token_prefix_prefills_only_the_remainder(two_layer_model_path):
    llm = _engine(two_layer_model_path)
    prefix = llm.tokenizer.encode(long_prompt(40))[:512]
    first = prefix + llm.tokenizer.encode(" First question: what happened in section 3?")
    second = prefix + llm.tokenizer.encode(" Second question: who kept the ledger?")
    llm.generate(prompt_token_ids=[first], sampling_params=GREEDY)
    before = llm.stats().num_prefill_tokens
    (output,) = llm.generate(prompt_token_ids=[second], sampling_params=GREEDY)
    computed = llm.stats().num_prefill_tokens - before
    assert output.num_cached_tokens >= 496
    assert computed == len(second) - output.num_cached_tokens
    assert output.metrics.num_cached_tokens == output.num_cached_tokens


def test_exact_duplicate_recomputes_only_its_last_block(two_layer_model_path):
    llm = _engine(two_layer_model_path)
    prompt = llm.tokenizer.encode(long_prompt(4))
    (first,) = llm.generate(prompt_token_ids=[prompt], sampling_params=GREEDY)
    (again,) = llm.generate(prompt_token_ids=[prompt], sampling_params=GREEDY)
    block_size = llm.config.cache.block_size
    assert again.num_cached_tokens == (len(prompt) - 1) // block_size * block_size
    assert again.token_ids == first.token_ids


def test_pinned_prefix_survives_eviction_pressure(model_path):
    block_bytes = 2 * 30 * 16 * 3 * 64 * 4
    llm = _engine(model_path, kv_cache_memory_bytes=48 * block_bytes, max_model_len=512)
    pinned = llm.pin_system_prompt(SYSTEM_PROMPTS[1])
    assert pinned.num_tokens >= 16
    for index in range(6):  # each ~400 tokens: the whole free pool is cycled
        llm.generate([long_prompt(5) + f" Variant {index}."], SamplingParams(temperature=0, max_tokens=2))
    conversation = [{"role": "system", "content": SYSTEM_PROMPTS[1]}, {"role": "user", "content": "Hi"}]
    output = llm.chat(conversation, GREEDY)
    assert output.num_cached_tokens == pinned.num_tokens
    llm.unpin_prefix(pinned.pin_id)
    assert all_blocks_free(llm) and llm.stats().num_pinned_tokens == 0


def test_pin_needs_a_full_block_and_the_cache(model_path, llm):
    with pytest.raises(ValueError, match="^prefix: .*shorter than one KV block"):
        llm.pin_prefix([1, 2, 3])
    off = _engine(model_path, enable_prompt_cache=False)
    with pytest.raises(ValueError, match="prompt cache is disabled"):
        off.pin_prefix(list(range(100, 140)))


def test_pins_hold_at_most_their_share_of_the_cache(model_path):
    block_bytes = 2 * 30 * 16 * 3 * 64 * 4
    llm = _engine(
        model_path, kv_cache_memory_bytes=40 * block_bytes, max_pinned_fraction=0.25, max_model_len=256
    )
    first = llm.pin_prefix(list(range(100, 100 + 6 * 16)), pin_id="six-blocks")
    with pytest.raises(
        ValueError, match=r"^prefix: pinning 6 more KV blocks would make 12 pinned, over the limit of 10"
    ):
        llm.pin_prefix(list(range(300, 300 + 6 * 16)), pin_id="six-more")
    assert "six-more" not in llm.core.pinned_prefixes.resident
    llm.pin_prefix(list(range(300, 300 + 4 * 16)), pin_id="four-more")  # 10 of 10: at the limit
    llm.unpin_prefix(first.pin_id)
    llm.pin_prefix(list(range(300, 300 + 6 * 16)), pin_id="six-more")
    with pytest.raises(ValueError, match=r"max_pinned_fraction: must be a finite number in \[0, 1\]"):
        _engine(model_path, max_pinned_fraction=1.5)


def test_pins_leave_a_request_of_max_model_len_room(model_path):
    """40 blocks, a request of max_model_len needing 32: pins may hold 8, whatever their share."""
    block_bytes = 2 * 30 * 16 * 3 * 64 * 4
    llm = _engine(
        model_path, kv_cache_memory_bytes=40 * block_bytes, max_pinned_fraction=0.5, max_model_len=512
    )
    llm.pin_prefix(list(range(100, 100 + 6 * 16)), pin_id="six-blocks")
    refusal = r"^prefix: .*fewer than the 32 blocks a request of max_model_len \(512"
    with pytest.raises(ValueError, match=refusal):
        llm.pin_prefix(list(range(300, 300 + 3 * 16)), pin_id="three-more")
    llm.pin_prefix(list(range(300, 300 + 2 * 16)), pin_id="two-more")  # 8 pinned: 32 left
    longest = list(range(1000, 1000 + 500))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    (output,) = llm.generate(prompt_token_ids=[longest], sampling_params=params)
    assert len(output.token_ids) == 12
    assert llm.stats().num_pinned_tokens == 8 * 16


def test_reset_frees_every_block(two_layer_model_path):
    llm = _engine(two_layer_model_path)
    llm.pin_prefix(long_prompt(2))
    llm.generate([long_prompt(3)], GREEDY)
    llm.reset_prefix_cache()
    stats = llm.stats()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks and stats.num_pinned_tokens == 0
    (output,) = llm.generate([long_prompt(3)], GREEDY)
    assert output.num_cached_tokens == 0


def test_persisted_pin_is_restored_and_hits_after_a_restart(two_layer_model_path, tmp_path):
    folder = str(tmp_path / "prompt-cache")
    conversation = [
        {"role": "system", "content": SYSTEM_PROMPTS[2]},
        {"role": "user", "content": "Summarize."},
    ]
    first_engine = _engine(two_layer_model_path, prompt_cache_dir=folder)
    pinned = first_engine.pin_system_prompt(SYSTEM_PROMPTS[2], pin_id="system")
    expected = first_engine.chat(conversation, GREEDY)
    assert os.listdir(folder) == ["system.safetensors"]
    del first_engine
    restarted = _engine(two_layer_model_path, prompt_cache_dir=folder)
    assert [p.pin_id for p in restarted.pinned_prefixes()] == ["system"]
    output = restarted.chat(conversation, GREEDY)
    assert output.num_cached_tokens == pinned.num_tokens == expected.num_cached_tokens
    assert output.token_ids == expected.token_ids
    assert restarted.pin_system_prompt(SYSTEM_PROMPTS[2], pin_id="system") == pinned
    restarted.unpin_prefix("system")
    assert os.listdir(folder) == []


def test_mismatched_or_corrupt_files_are_refused_and_the_engine_starts(
    two_layer_model_path, tmp_path, caplog
):
    folder = str(tmp_path / "prompt-cache")
    writer = _engine(two_layer_model_path, prompt_cache_dir=folder)
    writer.pin_prefix(long_prompt(2), pin_id="prefix")
    with open(os.path.join(folder, "broken.safetensors"), "wb") as handle:
        handle.write(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    other_block_size = _engine(two_layer_model_path, prompt_cache_dir=folder, block_size=32)
    assert other_block_size.pinned_prefixes() == []
    messages = " ".join(record.getMessage() for record in caplog.records)
    assert "block_size=16" in messages and "block_size=32" in messages
    assert "broken.safetensors" in messages
    (output,) = other_block_size.generate([long_prompt(2)], GREEDY)
    assert len(output.token_ids) == GREEDY.max_tokens
    same = _engine(two_layer_model_path, prompt_cache_dir=folder)
    assert [p.pin_id for p in same.pinned_prefixes()] == ["prefix"]
