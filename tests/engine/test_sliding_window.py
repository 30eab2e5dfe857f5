"""Sliding-window models past their window: transformers' tokens, and KV memory bounded by the window."""

from __future__ import annotations


import pytest
import torch

from firsttoken import LLM, SamplingParams
from firsttoken.models.loaders.conversion_cache import default_cache_dir
from tests.conftest import FIXED_THREADS
from tests.models.reference import hf_greedy
from tests.models.tiny_models import save_hf_folder, tiny_hf_model

WINDOW = 16
BLOCK_SIZE = 8
PROMPT_IDS = [(7 * index + 3) % 4000 + 30 for index in range(90)]
NUM_TOKENS = 24


@pytest.fixture(scope="module")
def windowed_model(tmp_path_factory):
    """A tiny Mistral with a 16-token window, as transformers runs it and as a folder."""
    hf_model = tiny_hf_model("mistral", tie_word_embeddings=False, sliding_window=WINDOW)
    return hf_model, save_hf_folder(hf_model, str(tmp_path_factory.mktemp("mistral-window")))


def _engine(path: str, **options) -> LLM:
    settings = dict(
        dtype="float32",
        kv_cache_memory_bytes=4 << 20,
        block_size=BLOCK_SIZE,
        chunk_size=32,
        cache_dir=default_cache_dir(),
        **FIXED_THREADS,
    )
    return LLM(path, **{**settings, **options})


GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)


def test_the_window_changes_what_transformers_says(windowed_model):
    """The prompt runs far enough past the window that full attention would answer otherwise."""
    hf_model, _ = windowed_model
    full = tiny_hf_model("mistral", tie_word_embeddings=False, sliding_window=None)
    assert hf_greedy(full, PROMPT_IDS, NUM_TOKENS)[0] != hf_greedy(hf_model, PROMPT_IDS, NUM_TOKENS)[0]


@pytest.mark.parametrize("native_kernels", [True, False], ids=["native", "sdpa"])
def test_past_the_window_alone_batched_chunked_and_on_a_prefix_hit(windowed_model, native_kernels):
    hf_model, folder = windowed_model
    llm = _engine(folder, native_kernels=native_kernels)
    expected = hf_greedy(hf_model, PROMPT_IDS, NUM_TOKENS)[0]
    (alone,) = llm.generate(prompt_token_ids=[PROMPT_IDS], sampling_params=GREEDY)
    assert alone.token_ids == expected
    other_prompt = PROMPT_IDS[5:61]
    cached, beside = llm.generate(prompt_token_ids=[PROMPT_IDS, other_prompt], sampling_params=GREEDY)
    assert cached.num_cached_tokens > 0
    assert cached.token_ids == expected
    assert beside.token_ids == hf_greedy(hf_model, other_prompt, NUM_TOKENS)[0]
    stats = llm.stats()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks


def test_a_long_sequence_holds_about_its_windows_blocks(windowed_model):
    """Prefilled in chunks of 32 then decoded 200 tokens in a KV cache of 16 blocks, where full
    attention would need 37: never more blocks than the window and one step's tokens."""
    _, folder = windowed_model
    llm = _engine(
        folder,
        enable_prompt_cache=False,
        kv_cache_memory_bytes=16 * BLOCK_SIZE * 512,
        max_num_batched_tokens=32,
        max_num_seqs=4,
    )
    assert llm.stats().num_kv_blocks == 16
    most_held = 0
    for _ in llm.stream(PROMPT_IDS, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)):
        stats = llm.stats()
        most_held = max(most_held, stats.num_kv_blocks - stats.num_free_kv_blocks)
    assert most_held <= -(-(WINDOW - 1 + 32) // BLOCK_SIZE) + 1
    stats = llm.stats()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks


def test_a_window_on_some_layers_only_serves_up_to_the_window():
    """Qwen2 windows only the layers from max_window_layers on: past the window that is not
    served (yet), so the context is capped where full attention gives the same tokens."""
    from firsttoken.models.loaders.hf_folder import arch_from_config
    from firsttoken.worker.model_loading import max_model_len

    config = dict(
        model_type="qwen2",
        hidden_size=64,
        num_attention_heads=4,
        intermediate_size=128,
        num_hidden_layers=2,
        vocab_size=100,
        use_sliding_window=True,
        sliding_window=WINDOW,
        max_window_layers=1,
    )
    cpu = torch.device("cpu")
    upper_only = arch_from_config(config, "qwen2")
    assert upper_only.sliding_window_layers == (1,)
    assert max_model_len(upper_only, None, cpu) == WINDOW
    everywhere = arch_from_config({**config, "max_window_layers": 0}, "qwen2")
    assert max_model_len(everywhere, None, cpu) == 4096
    assert max_model_len(everywhere, None, torch.device("cuda")) == WINDOW
