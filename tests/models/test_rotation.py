"""QuaRot's rotations: the Hadamard transform of down_proj's inputs is the orthogonal matrix
folded into its weights, a rotated float model computes the same function (biases, grouped
heads and untied heads included), and models it cannot turn are refused with the reason."""

from __future__ import annotations

import glob
import os

import pytest
import torch
from safetensors.torch import save_file

from firsttoken import LLM, SamplingParams
from firsttoken.errors import InvalidInputError
from firsttoken.models import rotation
from firsttoken.models.rotation import rotate_model, rotation_unsupported_reason
from firsttoken.ops.hadamard import BlockHadamard, hadamard_block, walsh_hadamard
from firsttoken.worker import model_loading
from tests.conftest import FIXED_THREADS
from tests.models.tiny_models import save_hf_folder, tiny_hf_model

FLOAT_OPTIONS = dict(
    dtype="float32", batch_invariant=False, enable_prompt_cache=False, kv_cache_memory_bytes=64 << 20,
    **FIXED_THREADS,
)
PROMPTS = ["The three primary colors are", "What is 17 times 23? Show each step of the multiplication."]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
# float64 rotations rounded to float32 weights: the turned model's logprobs moved by ~1e-5 on the
# embedded model; a wrong fold moves them by whole units.
LOGPROB_TOLERANCE = 1e-3


@pytest.mark.parametrize(
    "features, block", [(1536, 512), (11008, 256), (128, 128), (96, 32), (576, 64), (7, 1)]
)
def test_the_hadamard_block_is_the_largest_power_of_two_dividing_the_inputs_up_to_512(features, block):
    assert hadamard_block(features) == block


@pytest.mark.parametrize("features", [1536, 96, 8])
def test_the_factored_transform_is_the_orthogonal_matrix_folded_into_the_weights(features):
    hadamard = BlockHadamard(features)
    matrix = torch.block_diag(*[walsh_hadamard(hadamard.block)] * (features // hadamard.block))
    torch.testing.assert_close(matrix @ matrix.t(), torch.eye(features, dtype=torch.float64))
    x = torch.randn(5, features)
    torch.testing.assert_close(hadamard(x), (x.double() @ matrix).float(), atol=1e-5, rtol=1e-5)


def _replies(llm: LLM) -> list[tuple[list[int], list[float]]]:
    return [
        (output.token_ids, [entry.logprob for entry in output.logprobs])
        for output in llm.generate(PROMPTS, GREEDY)
    ]


def _assert_the_same_function(before, after) -> None:
    for (tokens, logprobs), (turned_tokens, turned_logprobs) in zip(before, after, strict=True):
        assert turned_tokens == tokens
        assert max(abs(a - b) for a, b in zip(logprobs, turned_logprobs, strict=True)) < LOGPROB_TOLERANCE


@pytest.mark.parametrize(
    "model_type, overrides",
    [("qwen2", {}), ("llama", {"tie_word_embeddings": True})],
    ids=["qkv-bias-untied-head", "tied-head"],
)
def test_a_rotated_float_model_gives_the_same_tokens_and_logprobs(tmp_path, model_type, overrides):
    folder = save_hf_folder(tiny_hf_model(model_type, **overrides), str(tmp_path / model_type))
    llm = LLM(folder, **FLOAT_OPTIONS)
    try:
        before = _replies(llm)
        rotate_model(llm.core.single_rank_model())
        _assert_the_same_function(before, _replies(llm))
    finally:
        llm.shutdown()


def test_the_embedded_model_rotated_gives_the_same_tokens_and_logprobs(model_path):
    llm = LLM(model_path, **FLOAT_OPTIONS)
    try:
        model = llm.core.single_rank_model()
        before = _replies(llm)
        rotate_model(model)
        assert model.lm_head.weight is not model.embed_weight
        assert torch.equal(model.layers[0].input_norm_weight, torch.ones(576))
        _assert_the_same_function(before, _replies(llm))
    finally:
        llm.shutdown()


def test_norms_after_attention_and_mlp_are_refused_with_the_reason(tmp_path, monkeypatch):
    folder = save_hf_folder(
        tiny_hf_model("gemma3_text", sliding_window=16, head_dim=16, num_hidden_layers=2),
        str(tmp_path / "gemma3"),
    )
    llm = LLM(folder, **FLOAT_OPTIONS)
    try:
        assert "do not commute with a rotation" in rotation_unsupported_reason(llm.core.single_rank_model())
    finally:
        llm.shutdown()
    # The rotation is refused before any projection is quantized, on CPUs with or without W8A8.
    monkeypatch.setattr(model_loading, "w8a8_unsupported_reason", lambda device, kernels=None: None)
    with pytest.raises(InvalidInputError, match="w8a8_rotation: norms after the attention"):
        LLM(folder, quantization="w8a8", w8a8_rotation=True, **FLOAT_OPTIONS)


def test_a_second_start_reads_the_turned_weights_from_the_cache_with_the_same_bits(tmp_path, monkeypatch):
    """The turned weights are written to the conversion cache once per checkpoint and dtype; a
    start that finds them turns nothing and replies bit for bit as the start that turned them.
    A cached file whose tensors are not the model's is turned again and replaced."""
    folder = save_hf_folder(tiny_hf_model("qwen2"), str(tmp_path / "qwen2"))
    cache = tmp_path / "cache"
    options = dict(quantization="w8a8", w8a8_rotation=True, cache_dir=str(cache), **FLOAT_OPTIONS)
    monkeypatch.setattr(model_loading, "w8a8_unsupported_reason", lambda device, kernels=None: None)

    def replies_of_a_start() -> list[tuple[list[int], list[float]]]:
        llm = LLM(folder, **options)
        try:
            return _replies(llm)
        finally:
            llm.shutdown()

    turned = replies_of_a_start()
    (cached_file,) = glob.glob(os.path.join(cache, "converted", "*quarot*", "weights-float32.safetensors"))
    turning = rotation.turned_weights
    with monkeypatch.context() as patch:
        patch.setattr(rotation, "turned_weights", lambda model: pytest.fail("a cached start turned it"))
        assert replies_of_a_start() == turned
    save_file({"embed_weight": torch.zeros(3)}, cached_file)
    turns = []
    monkeypatch.setattr(rotation, "turned_weights", lambda model: turns.append(1) or turning(model))
    assert replies_of_a_start() == turned
    assert turns == [1]
    assert replies_of_a_start() == turned
    assert turns == [1]
