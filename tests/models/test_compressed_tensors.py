"""W8A8 checkpoints in the compressed-tensors layout: a tiny random Llama quantized as
llm-compressor writes it (int8 weights, per-channel scales, dynamic per-token activations) runs
on exactly its levels and scales, projections it ignores stay float, and schemes the engine
cannot run are refused naming the field. The quantization it runs under is resolved into the
engine's config once, and its worker runs that config as given."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from firsttoken import LLM, SamplingParams
from firsttoken.errors import InvalidInputError
from firsttoken.models.loaders.hf_folder import load_hf_folder
from firsttoken.ops.w8a8 import w8a8_unsupported_reason
from firsttoken.ops.w8a8_linear import W8A8Linear, w8a8_linear_reference
from firsttoken.config import EngineConfig
from firsttoken.worker import checkpoint_quantization, model_loading
from firsttoken.worker.worker import Worker
from tests.conftest import FIXED_THREADS
from tests.models.reference import hf_greedy
from tests.models.tiny_models import save_hf_folder, tiny_hf_model

UNSUPPORTED = w8a8_unsupported_reason(torch.device("cpu"))
needs_exact_int8 = pytest.mark.skipif(UNSUPPORTED is not None, reason=f"{UNSUPPORTED}")
PROMPT_IDS = [504, 3575, 282, 4649, 314, 7042, 30, 198, 17, 33, 34, 1708, 2988, 216, 1062, 45] * 3
NUM_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=8)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The quantization_config llm-compressor writes for its W8A8 scheme (SmoothQuant + GPTQ recipes).
W8A8_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "int-quantized",
    "quantization_status": "compressed",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {
                "num_bits": 8,
                "type": "int",
                "symmetric": True,
                "strategy": "channel",
                "dynamic": False,
                "group_size": None,
                "observer": "minmax",
            },
            "input_activations": {
                "num_bits": 8,
                "type": "int",
                "symmetric": True,
                "strategy": "token",
                "dynamic": True,
                "group_size": None,
                "observer": None,
            },
            "output_activations": None,
        }
    },
    "ignore": ["lm_head"],
}


def _quantized_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 levels [out, in] and bf16 scales [out, 1], as llm-compressor stores them.
    The scales are wider than each row's largest weight needs (as an MSE observer or GPTQ's
    updates leave them), so requantizing the dequantized weights would give other levels."""
    widening = 1 + 0.3 * torch.rand(weight.shape[0], 1, generator=torch.Generator().manual_seed(0))
    scales = (weight.abs().amax(dim=1, keepdim=True) * widening / 127).to(torch.bfloat16)
    levels = torch.round(weight / scales.float()).clamp(-127, 127).to(torch.int8)
    return levels, scales


def write_w8a8_folder(
    hf_model, folder: str, ignore: tuple[str, ...] = (), quantization_config: dict | None = None
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """`hf_model` saved as a compressed-tensors W8A8 folder, the projections named in `ignore`
    (module names) left float; returns each quantized projection's (levels, scales)."""
    save_hf_folder(hf_model, folder)
    weights_file = os.path.join(folder, "model.safetensors")
    tensors = load_file(weights_file)
    stored = {}
    for name in list(tensors):
        module = name.removesuffix(".weight")
        if not name.endswith(".weight") or module.split(".")[-1] not in PROJECTIONS or module in ignore:
            continue
        levels, scales = _quantized_per_channel(tensors[name])
        tensors[name], tensors[f"{module}.weight_scale"] = levels, scales
        stored[module] = (levels, scales.float().reshape(-1))
    save_file(tensors, weights_file, metadata={"format": "pt"})
    config_file = os.path.join(folder, "config.json")
    with open(config_file, encoding="utf-8") as handle:
        config = json.load(handle)
    config["quantization_config"] = quantization_config or {**W8A8_CONFIG, "ignore": ["lm_head", *ignore]}
    with open(config_file, "w", encoding="utf-8") as handle:
        json.dump(config, handle)
    return stored


def emulate_w8a8(hf_model, stored: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
    """transformers' projections computing W8A8 from the stored levels (float64 sums): the
    reference for the engine."""
    for module_name, (levels, scales) in stored.items():
        linear = hf_model.get_submodule(module_name)
        bias = linear.bias

        def forward(x, levels=levels, scales=scales, bias=bias):
            return w8a8_linear_reference(x, levels, scales, bias)

        linear.forward = forward


def _engine(path: str, **options) -> LLM:
    return LLM(
        path,
        dtype="float32",
        kv_cache_memory_bytes=16 << 20,
        chunk_size=32,
        block_size=8,
        **FIXED_THREADS,
        **options,
    )


def _first_logprobs_error(output, expected_logprobs: torch.Tensor) -> float:
    return max(
        abs(alternative.logprob - float(expected_logprobs[alternative.token_id]))
        for alternative in output.logprobs[0].top_logprobs
    )


@needs_exact_int8
def test_a_w8a8_checkpoint_runs_on_its_own_levels_and_scales(tmp_path):
    hf_model = tiny_hf_model("llama", tie_word_embeddings=False)
    stored = write_w8a8_folder(hf_model, str(tmp_path / "w8a8"), ignore=("model.layers.1.mlp.down_proj",))
    llm = _engine(str(tmp_path / "w8a8"))
    model = llm.core.single_rank_model()
    assert llm.inspect().quantization == "w8a8"
    qkv = model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, W8A8Linear) and isinstance(model.layers[1].mlp.gate_up_proj, W8A8Linear)
    assert not isinstance(model.layers[1].mlp.down_proj, W8A8Linear)  # ignored: float
    assert not isinstance(model.lm_head, W8A8Linear)
    # The fused q|k|v projection multiplies by the stored levels and scales, in their order.
    parts = [stored[f"model.layers.0.self_attn.{name}"] for name in ("q_proj", "k_proj", "v_proj")]
    levels, scales = torch.cat([part[0] for part in parts]), torch.cat([part[1] for part in parts])
    x = torch.randn(5, levels.shape[1])
    torch.testing.assert_close(qkv(x), w8a8_linear_reference(x, levels, scales, None), rtol=1e-5, atol=1e-5)

    (output,) = llm.generate(prompt_token_ids=[PROMPT_IDS], sampling_params=GREEDY)
    float_ids, float_logprobs = hf_greedy(hf_model, PROMPT_IDS, NUM_TOKENS)
    emulate_w8a8(hf_model, stored)
    expected_ids, expected_logprobs = hf_greedy(hf_model, PROMPT_IDS, NUM_TOKENS)
    assert output.token_ids == expected_ids
    # Against the emulated W8A8 only float32 roundings differ; the float model is further off,
    # so the test would see the levels or the activations' quantization gone.
    error = _first_logprobs_error(output, expected_logprobs)
    assert error < 1e-3
    assert _first_logprobs_error(output, float_logprobs) > 10 * error


def _without_exact_int8_sums(monkeypatch) -> None:
    """The engine config's resolution and the model's loading both see a CPU whose oneDNN
    saturates int8 sums."""
    for module in (checkpoint_quantization, model_loading):
        monkeypatch.setattr(module, "w8a8_unsupported_reason", lambda device, kernels=None: "w8a8 needs VNNI")


@needs_exact_int8
def test_the_engines_config_says_w8a8_where_the_checkpoint_runs_as_w8a8(tmp_path):
    """The engine core and its inspection read the config resolved before the worker was
    built, not an unresolved copy beside the worker's rewritten one."""
    write_w8a8_folder(tiny_hf_model("llama"), str(tmp_path / "w8a8"))
    llm = _engine(str(tmp_path / "w8a8"))
    assert llm.core.config.model_config.quantization == "w8a8"
    assert llm.config is llm.core.config
    assert llm.inspect().quantization == "w8a8"
    assert any(isinstance(module, W8A8Linear) for module in llm.core.single_rank_model().modules())


def test_a_worker_refuses_a_config_that_was_not_resolved_against_its_checkpoint(tmp_path, monkeypatch):
    """A worker keeps the config it is handed; one that says otherwise than its checkpoint runs
    is refused. (On any CPU: no int8 product runs before the check.)"""
    monkeypatch.setattr(checkpoint_quantization, "w8a8_unsupported_reason", lambda device, kernels=None: None)
    write_w8a8_folder(tiny_hf_model("llama"), str(tmp_path / "w8a8"))
    unresolved = EngineConfig.from_kwargs(model=str(tmp_path / "w8a8"), device="cpu", **FIXED_THREADS)
    refusal = "quantization: .* runs as 'w8a8' on cpu, but the worker was handed None"
    with pytest.raises(InvalidInputError, match=refusal):
        Worker(unresolved)
    resolved = checkpoint_quantization.resolve_checkpoint_quantization(unresolved)
    assert resolved.model_config.quantization == "w8a8"
    assert checkpoint_quantization.resolve_checkpoint_quantization(resolved) is resolved
    assert Worker(resolved).config is resolved


def test_without_exact_int8_sums_the_checkpoint_runs_its_dequantized_weights(tmp_path, monkeypatch, caplog):
    _without_exact_int8_sums(monkeypatch)
    hf_model = tiny_hf_model("llama", tie_word_embeddings=True)
    stored = write_w8a8_folder(hf_model, str(tmp_path / "w8a8"))
    with caplog.at_level(logging.WARNING, logger=checkpoint_quantization.__name__):
        llm = _engine(str(tmp_path / "w8a8"))
    assert caplog.text.count("is a W8A8 checkpoint; running its dequantized weights: w8a8 needs VNNI") == 1
    assert llm.inspect().quantization is None and llm.config.model_config.quantization is None
    model = llm.core.single_rank_model()
    assert not any(isinstance(module, W8A8Linear) for module in model.modules())
    with torch.no_grad():
        for module_name, (levels, scales) in stored.items():
            hf_model.get_submodule(module_name).weight.copy_(levels.float() * scales[:, None])
    (output,) = llm.generate(prompt_token_ids=[PROMPT_IDS], sampling_params=GREEDY)
    expected_ids, expected_logprobs = hf_greedy(hf_model, PROMPT_IDS, NUM_TOKENS)
    assert output.token_ids == expected_ids
    assert _first_logprobs_error(output, expected_logprobs) < 1e-3
    with pytest.raises(InvalidInputError, match="quantization: w8a8 needs VNNI"):
        _engine(str(tmp_path / "w8a8"), quantization="w8a8")


def test_other_quantizations_and_calibrated_maxima_are_refused_on_it(tmp_path):
    write_w8a8_folder(tiny_hf_model("llama"), str(tmp_path / "w8a8"))
    with pytest.raises(InvalidInputError, match="quantization: .* is a W8A8 checkpoint"):
        _engine(str(tmp_path / "w8a8"), quantization="int4")
    with pytest.raises(InvalidInputError, match="w8a8_activation_stats: .* is quantized already"):
        _engine(str(tmp_path / "w8a8"), quantization="w8a8", w8a8_activation_stats=str(tmp_path / "x"))


@pytest.mark.parametrize("int8_sums_exact", [True, False], ids=["w8a8", "dequantized"])
@pytest.mark.parametrize("method", ["smoothing", "gptq"])
def test_calibrating_it_is_refused_naming_the_model(method, int8_sums_exact, tmp_path, monkeypatch):
    """Whether the checkpoint runs as W8A8 or, without exact int8 sums, dequantized: its files
    are quantized already, so there is no float checkpoint to calibrate."""
    from firsttoken.calibration.calibrate import calibrate

    if not int8_sums_exact:
        _without_exact_int8_sums(monkeypatch)
    write_w8a8_folder(tiny_hf_model("llama"), str(tmp_path / "w8a8"))
    refusal = "model: .* is quantized already: calibrate its float checkpoint"
    with pytest.raises(InvalidInputError, match=refusal):
        calibrate(str(tmp_path / "w8a8"), "some text " * 20, 64, str(tmp_path / "out"), method=method)


def _with(path: tuple[str, ...], value) -> dict:
    config = json.loads(json.dumps(W8A8_CONFIG))
    owner = config
    for key in path[:-1]:
        owner = owner[key]
    owner[path[-1]] = value
    return config


UNSUPPORTED_SCHEMES = {
    "fp8": (("quant_method",), "fp8", "quant_method 'fp8'"),
    "packed int4": (("format",), "pack-quantized", "format 'pack-quantized'"),
    "static activations": (
        ("config_groups", "group_0", "input_activations", "dynamic"),
        False,
        "input_activations.dynamic False",
    ),
    "per-tensor weights": (("config_groups", "group_0", "weights", "strategy"), "tensor", "weights.strategy"),
    "asymmetric activations": (
        ("config_groups", "group_0", "input_activations", "symmetric"),
        False,
        "input_activations.symmetric",
    ),
    "weight-only": (
        ("config_groups", "group_0", "input_activations"),
        None,
        "input_activations of .* missing",
    ),
}


@pytest.mark.parametrize("scheme", sorted(UNSUPPORTED_SCHEMES))
def test_schemes_it_cannot_run_are_refused_naming_the_field(scheme, tmp_path):
    path, value, message = UNSUPPORTED_SCHEMES[scheme]
    folder = str(tmp_path / "model")
    write_w8a8_folder(tiny_hf_model("llama"), folder, quantization_config=_with(path, value))
    with pytest.raises(ValueError, match=f"model: .*{message}"):
        load_hf_folder(folder)


def test_a_fused_projection_with_int8_and_float_parts_is_refused(tmp_path):
    folder = str(tmp_path / "model")
    write_w8a8_folder(tiny_hf_model("llama"), folder, ignore=("model.layers.0.self_attn.k_proj",))
    with pytest.raises(ValueError, match="qkv_proj.weight mixes int8 and float parts"):
        _engine(folder)
