"""Models named by Hugging Face repo id come from the local Hugging Face cache, never the network."""

from __future__ import annotations

import os

import pytest

from firsttoken import LLM, SamplingParams
from firsttoken.models.registry import resolve_model_path
from tests.models.tiny_models import save_hf_folder, tiny_hf_model

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache folder that the hub library reads instead of the user's."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


def _cached_snapshot(cache, repo_id: str, revision: str = "main"):
    """The snapshot folder of `repo_id` laid out as the hub library writes it: refs name commits."""
    repo_folder = cache / ("models--" + repo_id.replace("/", "--"))
    (repo_folder / "refs").mkdir(parents=True)
    (repo_folder / "refs" / revision).write_text(COMMIT)
    snapshot = repo_folder / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    return snapshot


def test_repo_id_of_a_cached_folder_loads_and_generates(hub_cache):
    snapshot = _cached_snapshot(hub_cache, "tiny-org/tiny-llama")
    save_hf_folder(tiny_hf_model("llama"), str(snapshot))
    assert resolve_model_path("tiny-org/tiny-llama") == str(snapshot)
    assert resolve_model_path("tiny-org/tiny-llama@main") == str(snapshot)
    by_id = LLM("tiny-org/tiny-llama", dtype="float32", max_num_batched_tokens=64)
    by_path = LLM(str(snapshot), dtype="float32", max_num_batched_tokens=64)
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    assert (
        by_id.generate(["Hello there"], greedy)[0].token_ids
        == by_path.generate(["Hello there"], greedy)[0].token_ids
    )


def test_repo_id_of_a_cached_gguf_repo_is_its_gguf_file(hub_cache, model_path):
    snapshot = _cached_snapshot(hub_cache, "gguf-org/one-file-GGUF")
    os.symlink(model_path, snapshot / "model.Q4_1.gguf")
    assert resolve_model_path("gguf-org/one-file-GGUF") == str(snapshot / "model.Q4_1.gguf")


def test_repo_with_several_gguf_files_asks_for_one(hub_cache, model_path):
    snapshot = _cached_snapshot(hub_cache, "gguf-org/many-GGUF")
    for name in ("a.Q4_0.gguf", "a.Q8_0.gguf"):
        os.symlink(model_path, snapshot / name)
    with pytest.raises(
        ValueError, match=r"^model: gguf-org/many-GGUF holds 2 GGUF files \(a.Q4_0.gguf, a.Q8_0.gguf\)"
    ):
        resolve_model_path("gguf-org/many-GGUF")


def test_uncached_repo_id_names_the_cache_searched(hub_cache):
    with pytest.raises(
        ValueError, match=f"^model: nobody/absent is not in the local Hugging Face cache \\({hub_cache}\\)"
    ):
        resolve_model_path("nobody/absent")
    with pytest.raises(ValueError, match="with `hf download nobody/absent` "):
        resolve_model_path("nobody/absent")
    with pytest.raises(ValueError, match="cache .*`hf download tiny-org/tiny-llama --revision v2`"):
        resolve_model_path("tiny-org/tiny-llama@v2")


def test_path_that_is_neither_file_nor_repo_id():
    with pytest.raises(ValueError, match="^model: no such file or folder: /nonexistent/model.gguf"):
        resolve_model_path("/nonexistent/model.gguf")
