"""Loaders and architecture variants: tiny random checkpoints through firsttoken and transformers."""

from __future__ import annotations

import os
import pathlib

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors import SafetensorError

from firsttoken import LLM, SamplingParams
from firsttoken.models.loaders import conversion_cache
from firsttoken.models.loaders.conversion_cache import default_cache_dir
from tests.conftest import FIXED_THREADS, transformers_reading_gguf_quickly
from tests.models.reference import assert_logprobs_close, hf_greedy
from tests.models.tiny_models import save_hf_folder, tiny_hf_model, write_gguf

PROMPT_IDS = [
    504,
    3575,
    282,
    4649,
    314,
    7042,
    30,
    198,
    17,
    33,
    34,
    1708,
    2988,
    216,
    1062,
    45,
    990,
    12,
    87,
    8000,
] * 3
NUM_TOKENS = 16
TOLERANCE = 1e-3


@pytest.fixture(autouse=True)
def isolated_conversion_cache(tmp_path, monkeypatch):
    """A cache of this test's own for converted weights; the run's built kernels (a C build of
    seconds, the same for every test) are linked into it."""
    run_cache = pathlib.Path(default_cache_dir())
    (run_cache / "native").mkdir(parents=True, exist_ok=True)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    own_cache = pathlib.Path(default_cache_dir())
    own_cache.mkdir(parents=True)
    (own_cache / "native").symlink_to(run_cache / "native", target_is_directory=True)


def _engine(path: str) -> LLM:
    return LLM(
        path, dtype="float32", kv_cache_memory_bytes=16 << 20, chunk_size=32, block_size=8, **FIXED_THREADS
    )


GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=8)


def _firsttoken_run(path: str):
    (output,) = _engine(path).generate(prompt_token_ids=[PROMPT_IDS], sampling_params=GREEDY)
    return output


HF_VARIANTS = {
    "llama-untied-llama3-rope": (
        "llama",
        dict(
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        ),
    ),
    "llama-tied": ("llama", dict(tie_word_embeddings=True)),
    "mistral": ("mistral", dict(tie_word_embeddings=False, sliding_window=None)),
    "qwen2-bias": ("qwen2", dict(tie_word_embeddings=True)),
    "qwen3-qk-norm": ("qwen3", dict(tie_word_embeddings=True, head_dim=32)),
    "phi3-fused": ("phi3", dict(tie_word_embeddings=False)),
    "llama-attention-and-mlp-bias": (
        "llama", dict(tie_word_embeddings=False, attention_bias=True, mlp_bias=True)
    ),
    # Phi-4-mini's three quarters of each head rotating.
    "phi3-partial-rotary": ("phi3", dict(tie_word_embeddings=False, partial_rotary_factor=0.75)),
}


@pytest.mark.parametrize("variant", sorted(HF_VARIANTS))
def test_hf_folder_matches_transformers(variant, tmp_path):
    """Alone and prefilled in chunks of 32, then again beside another prompt: its whole blocks
    now a prefix-cache hit, the rest prefilled in the same steps as the other prompt's."""
    model_type, overrides = HF_VARIANTS[variant]
    hf_model = tiny_hf_model(model_type, **overrides)
    llm = _engine(save_hf_folder(hf_model, str(tmp_path / variant)))
    (alone,) = llm.generate(prompt_token_ids=[PROMPT_IDS], sampling_params=GREEDY)
    other_prompt = PROMPT_IDS[7:30]
    cached, beside = llm.generate(prompt_token_ids=[PROMPT_IDS, other_prompt], sampling_params=GREEDY)
    assert cached.num_cached_tokens > 0
    expected_ids, expected_logprobs = hf_greedy(hf_model, PROMPT_IDS, NUM_TOKENS)
    for output in (alone, cached):
        assert_logprobs_close(output.logprobs[0], expected_logprobs, TOLERANCE)
        assert output.token_ids == expected_ids
    assert beside.token_ids == hf_greedy(hf_model, other_prompt, NUM_TOKENS)[0]


def _phi3_longrope(original_max_position_embeddings: int) -> dict:
    """Phi-4-mini's rotary in a tiny Phi-3: LongRoPE over three quarters of each head (16 dims,
    12 rotating: 6 factors), its attention factor from 512 positions over the original ones."""
    return dict(
        tie_word_embeddings=False,
        partial_rotary_factor=0.75,
        original_max_position_embeddings=original_max_position_embeddings,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.75,
            "short_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0],
            "long_factor": [2.0, 4.0, 8.0, 16.0, 24.0, 32.0],
        },
    )


@pytest.mark.parametrize(
    "original_positions, max_model_len",
    [(128, 128), (32, None)],
    ids=["short-factors-within-the-original-context", "long-factors-for-a-longer-prompt"],
)
def test_longrope_matches_transformers_where_its_factors_agree(original_positions, max_model_len, tmp_path):
    """transformers picks the long factors per forward, when its last position passes the
    original context; firsttoken once, when the longest sequence it serves may. They agree for
    every sequence when neither passes it (an engine of 128 positions, prompt and reply within
    them) and for a prompt longer than it (60 tokens over an original 32): each case fails with
    the other factors."""
    hf_model = tiny_hf_model("phi3", **_phi3_longrope(original_positions))
    path = save_hf_folder(hf_model, str(tmp_path / "longrope"))
    llm = LLM(
        path, dtype="float32", kv_cache_memory_bytes=16 << 20, chunk_size=32, block_size=8,
        max_model_len=max_model_len, **FIXED_THREADS,
    )  # fmt: skip
    (output,) = llm.generate(prompt_token_ids=[PROMPT_IDS], sampling_params=GREEDY)
    expected_ids, expected_logprobs = hf_greedy(hf_model, PROMPT_IDS, NUM_TOKENS)
    assert_logprobs_close(output.logprobs[0], expected_logprobs, TOLERANCE)
    assert output.token_ids == expected_ids


GGUF_VARIANTS = {
    "llama-mixed-quants": (
        "llama",
        dict(tie_word_embeddings=False),
        {"token_embd": Q.F16, "attn_q": Q.Q8_0, "attn_k": Q.Q4_0, "attn_v": Q.Q4_1, "attn_output": Q.BF16,
         "ffn_gate": Q.Q4_0, "ffn_up": Q.Q8_0, "ffn_down": Q.Q4_1, "output.": Q.Q8_0},
    ),
    "qwen2-q8": ("qwen2", dict(tie_word_embeddings=True), {"blk": Q.Q8_0, "token_embd": Q.Q8_0}),
}


# The mixed quantizations by default (a GGUF Qwen2 is the slow tier's; Qwen2 folders run by default).
@pytest.mark.parametrize(
    "variant", ["llama-mixed-quants", pytest.param("qwen2-q8", marks=pytest.mark.slow)]
)
def test_gguf_file_matches_transformers_gguf_loader(variant, tmp_path):
    from transformers import AutoModelForCausalLM

    model_type, overrides, qtypes = GGUF_VARIANTS[variant]
    path = write_gguf(
        tiny_hf_model(model_type, **overrides), str(tmp_path / f"{variant}.gguf"), model_type, qtypes
    )
    with transformers_reading_gguf_quickly():
        hf_model = AutoModelForCausalLM.from_pretrained(
            str(tmp_path), gguf_file=os.path.basename(path), dtype=torch.float32
        )
    output = _firsttoken_run(path)
    expected_ids, expected_logprobs = hf_greedy(hf_model.eval(), PROMPT_IDS, NUM_TOKENS)
    assert_logprobs_close(output.logprobs[0], expected_logprobs, TOLERANCE)
    assert output.token_ids == expected_ids


def test_the_loaders_gguf_reader_reads_the_librarys_fields_and_tensors(model_path):
    """The loader's reader (the library's, on a plain view of the file map) on the embedded file:
    every field's contents, every tensor's name, type, shape, offset and bytes."""
    from gguf import GGUFReader

    from firsttoken.models.loaders.gguf_file import MappedGGUFReader

    library, mapped = GGUFReader(model_path), MappedGGUFReader(model_path)
    assert {name: field.contents() for name, field in mapped.fields.items()} == {
        name: field.contents() for name, field in library.fields.items()
    }
    assert len(mapped.tensors) == len(library.tensors) > 0
    for ours, theirs in zip(mapped.tensors, library.tensors):
        for attribute in ("name", "tensor_type", "data_offset"):
            assert getattr(ours, attribute) == getattr(theirs, attribute)
        assert ours.shape.tolist() == theirs.shape.tolist()
        assert np.array_equal(ours.data, theirs.data)


def _assert_gguf_gives_transformers_tokens(model_type: str, overrides: dict, tmp_path) -> None:
    """A float32 GGUF file of the tiny transformers model gives its greedy tokens and log-probs."""
    hf_model = tiny_hf_model(model_type, **overrides)
    path = write_gguf(hf_model, str(tmp_path / f"{model_type}.gguf"), model_type, {})
    output = _firsttoken_run(path)
    expected_ids, expected_logprobs = hf_greedy(hf_model, PROMPT_IDS, NUM_TOKENS)
    assert_logprobs_close(output.logprobs[0], expected_logprobs, TOLERANCE)
    assert output.token_ids == expected_ids


@pytest.mark.slow
@pytest.mark.parametrize(
    "model_type, overrides",
    [("qwen3", dict(tie_word_embeddings=True, head_dim=32)), ("phi3", dict(tie_word_embeddings=False))],
    ids=["qwen3-qk-norm", "phi3-fused"],
)
def test_gguf_of_qk_norm_and_fused_layouts_matches_transformers(model_type, overrides, tmp_path):
    """llama.cpp's names for Qwen3's q/k norms and Phi-3's fused qkv and gate|up tensors, in
    float32 so the file holds the transformers model's own weights."""
    _assert_gguf_gives_transformers_tokens(model_type, overrides, tmp_path)


@pytest.mark.parametrize(
    "model_type, overrides",
    [
        ("phi3", _phi3_longrope(32)),
        ("llama", dict(tie_word_embeddings=False, attention_bias=True, mlp_bias=True)),
    ],
    ids=["phi3-partial-longrope", "llama-attention-and-mlp-bias"],
)
def test_gguf_of_longrope_partial_rotary_and_biases_matches_transformers(model_type, overrides, tmp_path):
    """llama.cpp's Phi-3 LongRoPE (rope_factors_long/short tensors, the original context and
    attention factor as metadata) with rope.dimension_count under the head size; a Llama's
    q/k/v/o and MLP biases (q and k's in the converter's permuted rows). float32 files."""
    _assert_gguf_gives_transformers_tokens(model_type, overrides, tmp_path)


def test_gguf_partial_rotary_of_a_permuted_architecture_is_refused(tmp_path):
    """llama.cpp's Llama converter interleaves each whole head's rows: which dims rotate in a
    partial rotary file is not known."""
    from gguf import GGUFReader

    from firsttoken.models.loaders import gguf_file

    path = write_gguf(tiny_hf_model("llama"), str(tmp_path / "llama.gguf"), "llama", {})
    reader = GGUFReader(path)
    fields = {name: field.contents() for name, field in reader.fields.items()}
    fields["llama.rope.dimension_count"] = 8
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    with pytest.raises(ValueError, match="llama.rope.dimension_count 8 .* not supported"):
        gguf_file._arch_from_fields(fields, "llama", tensors)


def test_second_start_reads_the_conversion_cache(tmp_path):
    path = write_gguf(tiny_hf_model("llama"), str(tmp_path / "tiny.gguf"), "llama", {"blk": Q.Q8_0})
    first = _firsttoken_run(path)
    converted = os.listdir(tmp_path / "cache" / "firsttoken" / "converted")
    assert len(converted) == 1
    assert sorted(os.listdir(tmp_path / "cache" / "firsttoken" / "converted" / converted[0])) == [
        "meta.json", "tokenizer.json", "weights-float32.safetensors",
    ]
    second = _firsttoken_run(path)
    assert second.token_ids == first.token_ids


def test_weights_the_cache_cannot_take_leave_the_start_unharmed(tmp_path, monkeypatch, caplog):
    """safetensors reports a full disk as its own error, not an OSError: the start goes on and
    the next start converts again."""
    path = write_gguf(tiny_hf_model("llama"), str(tmp_path / "tiny.gguf"), "llama", {})

    def no_space(tensors, filename):
        raise SafetensorError("Error while serializing: I/O error: No space left on device")

    monkeypatch.setattr(conversion_cache, "save_file", no_space)
    first = _firsttoken_run(path)
    assert "could not write weights-float32.safetensors to the conversion cache" in caplog.text
    monkeypatch.undo()
    assert _firsttoken_run(path).token_ids == first.token_ids


def test_damaged_conversion_cache_is_rebuilt(tmp_path):
    path = write_gguf(tiny_hf_model("llama"), str(tmp_path / "tiny.gguf"), "llama", {})
    first = _firsttoken_run(path)
    folder = tmp_path / "cache" / "firsttoken" / "converted"
    (entry,) = os.listdir(folder)
    for name in os.listdir(folder / entry):
        with open(folder / entry / name, "wb") as handle:
            handle.write(b"\x00garbage")
    assert _firsttoken_run(path).token_ids == first.token_ids


@pytest.mark.parametrize("gguf_arch", ["llama", "qwen2", "gemma2"])
def test_the_converters_names_are_the_loaders_own_read_backwards(gguf_arch):
    from firsttoken.models.loaders.gguf_file import _hf_name, gguf_tensor_name

    parts = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"]
    if gguf_arch == "gemma2":
        parts += ["post_attention_norm", "ffn_norm", "post_ffw_norm"]
    names = ["token_embd.weight", "output_norm.weight", "output.weight"]
    names += [f"blk.7.{part}.weight" for part in parts] + ["blk.7.attn_q.bias"]
    for name in names:
        assert gguf_tensor_name(_hf_name(name, gguf_arch), gguf_arch) == name
