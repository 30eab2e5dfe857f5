"""StreamingLLM: attention sinks plus a window, positions as in the sinks-plus-window cache.

A one-layer model's keys and values depend on their token and position only, so there its
StreamingLLM output has an exact reference: transformers run on the cache's tokens alone (the
sinks, then the window), which puts them at the cache's positions.
"""

from __future__ import annotations

import pytest
import torch

from firsttoken import LLM, SamplingParams
from firsttoken.errors import InvalidInputError
from firsttoken.models.loaders.conversion_cache import default_cache_dir
from tests.conftest import FIXED_THREADS
from tests.engine_state import all_blocks_free, most_blocks_held
from tests.models.reference import hf_greedy
from tests.models.tiny_models import save_hf_folder, tiny_hf_model

SINK_TOKENS = 4
WINDOW = 16
BLOCK_SIZE = 4
PROMPT_IDS = [(11 * index + 5) % 3000 + 40 for index in range(40)]
NUM_TOKENS = 12


@pytest.fixture(scope="module")
def one_layer_model(tmp_path_factory):
    hf_model = tiny_hf_model("llama", num_hidden_layers=1, tie_word_embeddings=False)
    return hf_model, save_hf_folder(hf_model, str(tmp_path_factory.mktemp("one-layer")))


def _engine(path: str, **options) -> LLM:
    settings = dict(
        dtype="float32",
        kv_cache_memory_bytes=2 << 20,
        block_size=BLOCK_SIZE,
        chunk_size=8,
        cache_dir=default_cache_dir(),
        streaming_llm={"sink_tokens": SINK_TOKENS, "window": WINDOW},
        **FIXED_THREADS,
    )
    return LLM(path, **{**settings, **options})


def _streaming_reference(hf_model, prompt_ids: list[int], num_tokens: int) -> list[int]:
    """Greedy tokens, each from transformers over the sinks and the window that precede it."""
    tokens = list(prompt_ids)
    with torch.no_grad():
        for _ in range(num_tokens):
            cache = tokens if len(tokens) <= SINK_TOKENS + WINDOW else tokens[:SINK_TOKENS] + tokens[-WINDOW:]
            logits = hf_model(torch.tensor([cache])).logits[0, -1]
            tokens.append(int(logits.argmax()))
    return tokens[len(prompt_ids) :]


GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)


def test_one_layer_matches_transformers_on_the_cache_alone_batched_and_chunked(one_layer_model):
    hf_model, folder = one_layer_model
    llm = _engine(folder)
    expected = _streaming_reference(hf_model, PROMPT_IDS, NUM_TOKENS)
    # Past the window StreamingLLM answers otherwise than full attention: the test sees it.
    assert expected != hf_greedy(hf_model, PROMPT_IDS, NUM_TOKENS)[0]
    (alone,) = llm.generate(prompt_token_ids=[PROMPT_IDS], sampling_params=GREEDY)
    assert alone.token_ids == expected
    other_prompt = PROMPT_IDS[3:30]
    cached, beside = llm.generate(prompt_token_ids=[PROMPT_IDS, other_prompt], sampling_params=GREEDY)
    assert cached.token_ids == expected
    assert beside.token_ids == _streaming_reference(hf_model, other_prompt, NUM_TOKENS)
    whole_prompt = _engine(folder, chunk_size=64, enable_prompt_cache=False)
    (unchunked,) = whole_prompt.generate(prompt_token_ids=[PROMPT_IDS], sampling_params=GREEDY)
    assert unchunked.token_ids == expected


def test_within_sinks_and_window_it_is_full_attention(one_layer_model):
    _, folder = one_layer_model
    short_prompt = PROMPT_IDS[:10]
    params = SamplingParams(temperature=0, max_tokens=SINK_TOKENS + WINDOW - 10, ignore_eos=True)
    (streaming,) = _engine(folder).generate(prompt_token_ids=[short_prompt], sampling_params=params)
    (full,) = _engine(folder, streaming_llm=None).generate(
        prompt_token_ids=[short_prompt], sampling_params=params
    )
    assert streaming.token_ids == full.token_ids


def test_a_long_conversation_holds_the_sinks_and_the_windows_blocks(one_layer_model):
    """200 tokens decoded in a cache of 12 blocks: the sink block, the window's and a step's."""
    _, folder = one_layer_model
    # One layer, 2 KV heads of 16 float32: 256 bytes a token. Full attention would need 60 blocks.
    llm = _engine(
        folder,
        enable_prompt_cache=False,
        kv_cache_memory_bytes=12 * BLOCK_SIZE * 256,
        max_num_batched_tokens=8,
        max_num_seqs=4,
    )
    assert llm.stats().num_kv_blocks == 12
    most_held = most_blocks_held(
        llm, PROMPT_IDS, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    )
    assert most_held <= 1 + -(-(WINDOW - 1 + 8) // BLOCK_SIZE) + 1
    assert all_blocks_free(llm)


def test_streaming_without_the_native_kernels_is_refused_by_name(one_layer_model):
    _, folder = one_layer_model
    with pytest.raises(InvalidInputError, match="streaming_window"):
        _engine(folder, native_kernels=False)


def test_deeper_models_give_the_same_tokens_alone_batched_chunked_and_on_a_prefix_hit(tmp_path):
    """Past one layer there is no transformers reference (each key was computed over its own
    window); what holds is that every way of running a sequence gives the same tokens."""
    folder = save_hf_folder(tiny_hf_model("llama", num_hidden_layers=2), str(tmp_path / "two-layers"))
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    (whole,) = _engine(folder, chunk_size=64).generate(prompt_token_ids=[PROMPT_IDS], sampling_params=params)
    llm = _engine(folder)
    (alone,) = llm.generate(prompt_token_ids=[PROMPT_IDS], sampling_params=params)
    cached, _ = llm.generate(prompt_token_ids=[PROMPT_IDS, PROMPT_IDS[5:33]], sampling_params=params)
    assert cached.num_cached_tokens > 0
    assert whole.token_ids == alone.token_ids == cached.token_ids


def test_a_new_turn_reuses_the_sinks_and_window_after_the_middle_is_evicted(one_layer_model):
    """A 100-token conversation in a cache of 12 blocks (it spans 25): by its end the blocks
    between the sinks and the window are evicted, yet the next turn hits every whole block (the
    sinks and its window are all it reads) and says what it says with nothing cached."""
    _, folder = one_layer_model
    options = dict(kv_cache_memory_bytes=12 * BLOCK_SIZE * 256, max_num_batched_tokens=8, max_num_seqs=4)
    llm = _engine(folder, **options)
    first_turn = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    (reply,) = llm.generate(prompt_token_ids=[PROMPT_IDS], sampling_params=first_turn)
    conversation = PROMPT_IDS + reply.token_ids
    next_turn = conversation + [57, 1024, 311, 9, 2700, 88]
    (answer,) = llm.generate(prompt_token_ids=[next_turn], sampling_params=GREEDY)
    # Computed: all but the reply's last token; reused: its whole blocks.
    assert answer.num_cached_tokens == (len(conversation) - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert all_blocks_free(llm)
    cold = _engine(folder, enable_prompt_cache=False, **options)
    (expected,) = cold.generate(prompt_token_ids=[next_turn], sampling_params=GREEDY)
    assert answer.token_ids == expected.token_ids
