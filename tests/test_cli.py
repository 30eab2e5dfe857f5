"""`firsttoken generate | chat | quantize`: sampling flags reach SamplingParams, bad values are
errors naming the field, quantize writes its file."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from firsttoken.cli import build_parser, main, sampling_params_from
from firsttoken.config import EngineConfig
from firsttoken.engine_args import engine_kwargs


def _params(*flags: str):
    return sampling_params_from(build_parser().parse_args(["generate", "hello", *flags]))


def test_every_sampling_flag_reaches_the_sampling_params():
    params = _params(
        "--temperature",
        "0.5",
        "--top-p",
        "0.9",
        "--top-k",
        "7",
        "--min-p",
        "0.1",
        "--seed",
        "3",
        "--presence-penalty",
        "0.5",
        "--frequency-penalty",
        "-0.5",
        "--repetition-penalty",
        "1.2",
        "--logit-bias",
        '{"42": -100, "7": 2.5}',
        "--min-tokens",
        "4",
        "--stop",
        "END",
        "--stop",
        "\n\n",
        "--stop-token-id",
        "2",
        "--stop-token-id",
        "9",
        "--bad-word",
        "Paris",
        "--ignore-eos",
        "--max-tokens",
        "12",
    )
    assert (params.temperature, params.top_p, params.top_k, params.min_p, params.seed) == (
        0.5,
        0.9,
        7,
        0.1,
        3,
    )
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0.5, -0.5, 1.2)
    assert dict(params.logit_bias) == {42: -100.0, 7: 2.5}
    assert (params.min_tokens, params.max_tokens, params.ignore_eos) == (4, 12, True)
    assert (
        params.stop == ("END", "\n\n") and params.stop_token_ids == (2, 9) and params.bad_words == ("Paris",)
    )


def test_defaults_leave_the_new_fields_off():
    params = _params()
    assert params.logit_bias is None and not params.processes_logits and not params.tracks_tokens


def test_logit_bias_that_is_not_a_json_object_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["generate", "hello", "--logit-bias", "[1, 2]"])
    assert exit_info.value.code == 2
    assert "--logit-bias: not a JSON object of token ids to biases" in capsys.readouterr().err


def test_out_of_range_value_names_the_field_before_loading_a_model(capsys):
    assert main(["generate", "hello", "--presence-penalty", "3", "--model", "/nonexistent.gguf"]) == 2
    assert "presence_penalty" in capsys.readouterr().err


@pytest.mark.parametrize("setting", ["bogus", "", "AVX512"])
def test_a_bad_isa_in_the_environment_is_a_usage_error_only_where_it_is_used(monkeypatch, capsys, setting):
    monkeypatch.setenv("FIRSTTOKEN_ISA", setting)
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["serve", "--help"])
    assert exit_info.value.code == 0
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["generate", "hello"])
    assert exit_info.value.code == 2
    assert f"argument --cpu-isa: $FIRSTTOKEN_ISA is {setting!r}, not one of auto" in capsys.readouterr().err
    given = build_parser().parse_args(["generate", "hello", "--cpu-isa", "avx2"])
    assert EngineConfig.from_kwargs(**engine_kwargs(given)).model_config.cpu_isa == "avx2"


def test_a_good_isa_in_the_environment_is_the_default_and_a_flag_wins(monkeypatch):
    monkeypatch.setenv("FIRSTTOKEN_ISA", "avx2")
    plain = build_parser().parse_args(["generate", "hello"])
    assert EngineConfig.from_kwargs(**engine_kwargs(plain)).model_config.cpu_isa == "avx2"
    given = build_parser().parse_args(["generate", "hello", "--cpu-isa", "avx512"])
    assert EngineConfig.from_kwargs(**engine_kwargs(given)).model_config.cpu_isa == "avx512"


@pytest.mark.slow  # two generations; bad_words itself is checked by default in the engine and API tests
@pytest.mark.usefixtures("model_path")  # the embedded model, loaded by the code under test
def test_bad_word_changes_the_greedy_reply(capsys):
    prompt = ["generate", "The capital of France is", "--temperature", "0", "--max-tokens", "6"]
    assert main(prompt) == 0
    plain_reply = capsys.readouterr().out
    first_word = plain_reply.split()[0]
    assert main([*prompt, "--bad-word", first_word]) == 0
    banned_reply = capsys.readouterr().out
    assert banned_reply != plain_reply and first_word not in banned_reply.split()


@pytest.mark.usefixtures("model_path")
def test_quantize_writes_every_projections_input_maxima(tmp_path, capsys):
    from safetensors.torch import load_file

    text = tmp_path / "calibration.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 20, encoding="utf-8")
    output = tmp_path / "maxima.safetensors"
    command = ["quantize", "--calibration-text", str(text), "--num-tokens", "64", "--output", str(output)]
    assert main(command) == 0
    maxima = load_file(str(output))
    assert len(maxima) == 30 * 4 and maxima["layers.0.qkv_proj"].shape == (576,)
    assert maxima["layers.29.down_proj"].shape == (1536,) and (maxima["layers.29.down_proj"] > 0).all()
    assert "over" in capsys.readouterr().err


def test_quantize_by_gptq_writes_every_turned_projections_int8_levels(
    two_layer_model_path, tmp_path, capsys
):
    import torch
    from safetensors.torch import load_file

    text = tmp_path / "calibration.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 20, encoding="utf-8")
    output = tmp_path / "weights.safetensors"
    command = [
        "quantize", "--model", two_layer_model_path, "--method", "gptq", "--calibration-text", str(text),
        "--num-tokens", "64", "--output", str(output),
    ]
    assert main(command) == 0
    weights = load_file(str(output))
    assert len(weights) == 2 * 4 * 2
    assert weights["layers.1.down_proj.levels"].dtype == torch.int8
    assert weights["layers.1.down_proj.levels"].shape == (576, 1536)
    assert weights["layers.1.down_proj.scales"].shape == (576,)
    assert "GPTQ-rounded int8 weights" in capsys.readouterr().err


def test_quantize_refuses_a_token_count_below_one(tmp_path, capsys):
    text = tmp_path / "calibration.txt"
    text.write_text("hello", encoding="utf-8")
    command = ["quantize", "--calibration-text", str(text), "--num-tokens", "0", "--output", "x.safetensors"]
    assert main(command) == 2
    assert "num_tokens: must be >= 1" in capsys.readouterr().err


def test_version_prints_the_installed_distributions_version(capsys):
    import importlib.metadata

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"firsttoken {importlib.metadata.version('firsttoken')}\n"


def test_version_in_a_source_tree_without_an_install_is_the_packages_own(monkeypatch, capsys):
    import importlib.metadata

    import firsttoken

    def not_installed(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out == f"firsttoken {firsttoken.__version__} (source tree, not installed)\n"


ENGINE_DESCRIPTION = "model.gguf (llama, torch.float32 on cpu, native kernels for avx2)"
ENGINE_LINE = f"firsttoken: engine: {ENGINE_DESCRIPTION}\n"


class FakeLLM:
    """Streams a fixed reply, in pieces, with no engine behind it."""

    def __init__(self, model, **options) -> None:
        self.model = model

    def stream(self, prompt, params):
        return iter(SimpleNamespace(text=piece, metrics=None) for piece in (" Paris", ".", ""))

    def inspect(self):
        return SimpleNamespace(description=ENGINE_DESCRIPTION)


def _generate(monkeypatch, capsys, on_a_terminal: bool, *flags: str):
    import sys

    import firsttoken.engine.llm

    monkeypatch.setattr(firsttoken.engine.llm, "LLM", FakeLLM)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: on_a_terminal)
    assert main(["generate", "The capital of France is", *flags]) == 0
    return capsys.readouterr()


def test_generate_says_on_a_terminal_that_the_engine_is_starting(monkeypatch, capsys):
    shown = _generate(monkeypatch, capsys, True)
    assert shown.err.startswith("firsttoken: starting the engine")
    assert shown.err.endswith(ENGINE_LINE)
    assert shown.out == " Paris.\n"


def test_generate_into_a_pipe_or_with_no_progress_names_only_the_engine_it_runs(monkeypatch, capsys):
    assert _generate(monkeypatch, capsys, False) == (" Paris.\n", ENGINE_LINE)
    assert _generate(monkeypatch, capsys, True, "--no-progress") == (" Paris.\n", ENGINE_LINE)
