"""benchmarks/make_checkpoint.py writes what llama.cpp's converter and transformers would: the
GGUF file and the transformers folder of a seed hold the same weights in their own layouts, so
firsttoken gives the same log-probabilities on either, and transformers on the folder agrees."""

from __future__ import annotations

import os
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

from make_checkpoint import make, rope_permuted, shard_names  # noqa: E402

from firsttoken import LLM, SamplingParams  # noqa: E402
from firsttoken.models.loaders.gguf_file import undo_rope_permutation  # noqa: E402

PROMPT = [5, 900, 1234, 77, 4000, 31, 16000, 2222]
TOP_LOGPROBS = 5
# Both engines compute in float32 from the same bf16 weights; sums in other orders differ by
# rounding only.
LOGPROB_TOLERANCE = 1e-4


def first_token_logprobs(path: str) -> dict[int, float]:
    llm = LLM(model=path, dtype="float32", max_model_len=256)
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=TOP_LOGPROBS)
    sampled = llm.generate(prompt_token_ids=[PROMPT], sampling_params=params)[0].logprobs[0]
    return {entry.token_id: entry.logprob for entry in sampled.top_logprobs}


def transformers_logprobs(folder: str) -> dict[int, float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits[0, -1]
    top = torch.log_softmax(logits, dim=-1).topk(TOP_LOGPROBS)
    return dict(zip(top.indices.tolist(), top.values.tolist(), strict=True))


@pytest.fixture(scope="module")
def checkpoint_cache(tmp_path_factory) -> str:
    """One cache folder for the module: the tokenizer is converted once."""
    return str(tmp_path_factory.mktemp("checkpoints"))


def test_the_converters_rope_order_is_what_the_gguf_loader_undoes():
    weight = torch.arange(8 * 4 * 3, dtype=torch.float32).view(8 * 4, 3)
    assert torch.equal(undo_rope_permutation(rope_permuted(weight, 4), 4), weight)


def test_shards_keep_the_file_order_and_hold_at_most_their_size(monkeypatch):
    import make_checkpoint

    monkeypatch.setattr(make_checkpoint, "SHARD_BYTES", 64 * 64 * 2 * 3)
    names = [(f"w{index}", (64, 64)) for index in range(7)]
    shards = shard_names(names)
    assert [name for shard in shards for name, _ in shard] == [name for name, _ in names]
    assert [len(shard) for shard in shards] == [3, 3, 1]


@pytest.mark.parametrize(
    "model",
    [
        "tiny-llama3",
        pytest.param("tiny-qwen2", marks=pytest.mark.slow),
        pytest.param("tiny-llama-untied", marks=pytest.mark.slow),
    ],
)
def test_the_gguf_file_and_the_folder_give_transformers_logprobs(checkpoint_cache, model):
    paths = make(model, ["hf", "gguf-bf16"], seed=3, cache=checkpoint_cache)
    reference = transformers_logprobs(paths["hf"])
    for path in (paths["hf"], paths["gguf-bf16"]):
        ours = first_token_logprobs(path)
        assert list(ours) == list(reference), path
        for token_id, logprob in reference.items():
            assert ours[token_id] == pytest.approx(logprob, abs=LOGPROB_TOLERANCE), path


def test_a_second_make_rewrites_nothing(tmp_path):
    first = make("tiny-llama-untied", ["gguf-bf16"], seed=1, cache=str(tmp_path))["gguf-bf16"]
    written_at = os.stat(first).st_mtime_ns
    again = make("tiny-llama-untied", ["gguf-bf16"], seed=1, cache=str(tmp_path))["gguf-bf16"]
    assert again == first and os.stat(again).st_mtime_ns == written_at


def test_quantized_files_need_the_quantizer(tmp_path):
    with pytest.raises(SystemExit, match="--llama-cpp-python"):
        make("tiny-llama3", ["Q4_K_M"], cache=str(tmp_path))
