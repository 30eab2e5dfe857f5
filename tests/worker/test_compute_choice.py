"""The start-up choice of dtype and batch invariance: its rules on made-up timings, its cache,
the probe that times candidates, and an engine that runs what a cached choice says."""

from __future__ import annotations

import dataclasses
import json
import math
import os

import pytest
import torch

from firsttoken.config import AttentionConfig, ModelConfig
from firsttoken.errors import InvalidInputError
from firsttoken.models.arch import ModelArch
from firsttoken.ops.linear import cpu_computes_bf16
from firsttoken.worker.compute_choice import (
    BFLOAT16,
    FLOAT32,
    INVARIANCE_MAX_COST,
    NARROWER_DTYPE_MIN_GAIN,
    ComputeChoice,
    ComputeForm,
    ComputeRequest,
    FormTiming,
    candidate_forms,
    choice_key,
    choose_form,
    load_or_choose,
)
from firsttoken.worker.compute_probe import measure_forms, probe_tokens

AUTO = ComputeRequest("auto", "auto")

TINY_ARCH = ModelArch(
    architecture="llama",
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=512,
    tie_word_embeddings=True,
    attention_bias=False,
)


def timings(**by_label: tuple[float, float]) -> list[FormTiming]:
    """FormTimings from keywords such as `float32_on=(prefill_s, decode_s)`."""
    result = []
    for label, (prefill_s, decode_s) in by_label.items():
        dtype, invariance = label.rsplit("_", 1)
        result.append(FormTiming(ComputeForm(dtype, invariance == "on"), prefill_s, decode_s))
    return result


# -- candidates ---------------------------------------------------------------------------


def test_candidates_hold_bf16_only_where_onednn_has_bf16_kernels():
    with_bf16 = candidate_forms(AUTO, bf16_kernels=True)
    assert {form.dtype for form in with_bf16} == {FLOAT32, BFLOAT16}
    assert {form.dtype for form in candidate_forms(AUTO, bf16_kernels=False)} == {FLOAT32}
    assert len(with_bf16) == 4


def test_candidates_keep_what_the_options_fix():
    assert candidate_forms(ComputeRequest("bfloat16", True), bf16_kernels=True) == [
        ComputeForm(BFLOAT16, True)
    ]
    fixed_dtype = candidate_forms(ComputeRequest("float32", "auto"), bf16_kernels=True)
    assert fixed_dtype == [ComputeForm(FLOAT32, True), ComputeForm(FLOAT32, False)]
    fixed_invariance = candidate_forms(ComputeRequest("auto", False), bf16_kernels=True)
    assert fixed_invariance == [ComputeForm(FLOAT32, False), ComputeForm(BFLOAT16, False)]


# -- the rules ----------------------------------------------------------------------------


def test_invariance_stays_on_where_it_costs_at_most_the_limit():
    cost = INVARIANCE_MAX_COST * 0.8
    measured = timings(float32_on=(1.0 * (1 + cost), 0.020), float32_off=(1.0, 0.020))
    choice = choose_form(ComputeRequest("float32", "auto"), measured, 512)
    assert choice.batch_invariant
    assert "auto: on" in choice.invariance_reason and "+4%" in choice.invariance_reason


def test_invariance_goes_off_where_it_slows_the_decode_step_past_the_limit():
    measured = timings(bfloat16_on=(0.30, 0.030), bfloat16_off=(0.31, 0.025))
    choice = choose_form(ComputeRequest("bfloat16", "auto"), measured, 512)
    assert not choice.batch_invariant
    assert "auto: off" in choice.invariance_reason and "+20%" in choice.invariance_reason
    assert "batch_invariant=True keeps it" in choice.invariance_reason


def test_invariance_goes_off_where_it_slows_the_prefill_past_the_limit():
    measured = timings(float32_on=(1.3, 0.015), float32_off=(1.0, 0.060))
    assert not choose_form(ComputeRequest("float32", "auto"), measured, 512).batch_invariant


def test_invariance_asked_for_is_kept_whatever_it_costs():
    measured = timings(bfloat16_on=(0.9, 0.09))
    choice = choose_form(ComputeRequest("bfloat16", True), measured, 512)
    assert choice.batch_invariant and choice.invariance_reason == "batch invariance on, as asked"


def test_a_narrower_dtype_is_chosen_only_where_it_prefills_clearly_faster():
    clearly = 1.0 - NARROWER_DTYPE_MIN_GAIN * 2
    barely = 1.0 - NARROWER_DTYPE_MIN_GAIN / 2
    request = ComputeRequest("auto", True)
    fast_bf16 = choose_form(request, timings(float32_on=(1.0, 0.02), bfloat16_on=(clearly, 0.03)), 512)
    assert fast_bf16.dtype == BFLOAT16
    assert "prefills 20% faster than float32" in fast_bf16.dtype_reason
    assert "1000.0 ms per 512-token prefill" in fast_bf16.dtype_reason
    near_bf16 = choose_form(request, timings(float32_on=(1.0, 0.02), bfloat16_on=(barely, 0.01)), 512)
    assert near_bf16.dtype == FLOAT32
    slow_bf16 = choose_form(request, timings(float32_on=(1.0, 0.02), bfloat16_on=(1.4, 0.01)), 512)
    assert slow_bf16.dtype == FLOAT32


def test_each_dtype_is_judged_at_the_invariance_it_would_run():
    # bf16 with invariance is no faster than float32; without it, much faster, and invariance
    # costs bf16 more than the limit: bf16 without invariance wins.
    measured = timings(
        float32_on=(1.0, 0.02), float32_off=(1.1, 0.06), bfloat16_on=(0.95, 0.05), bfloat16_off=(0.5, 0.025)
    )
    choice = choose_form(AUTO, measured, 512)
    assert (choice.dtype, choice.batch_invariant) == (BFLOAT16, False)


def test_a_cpu_without_bf16_kernels_runs_float32_and_says_why():
    measured = timings(float32_on=(1.0, 0.02), float32_off=(1.2, 0.05))
    choice = choose_form(AUTO, measured, 256)
    assert (choice.dtype, choice.batch_invariant) == (FLOAT32, True)
    assert "no bf16 kernels" in choice.dtype_reason


def test_a_dtype_asked_for_is_kept():
    measured = timings(float32_on=(1.0, 0.02), float32_off=(0.5, 0.01))
    choice = choose_form(ComputeRequest("float32", "auto"), measured, 512)
    assert choice.dtype == FLOAT32 and choice.dtype_reason == "dtype float32, as asked"


# -- the cache ----------------------------------------------------------------------------


class CountingMeasure:
    def __init__(self, measured: list[FormTiming]) -> None:
        self.measured = measured
        self.calls = 0

    def __call__(self) -> tuple[list[FormTiming], int]:
        self.calls += 1
        return self.measured, 512


def test_a_choice_is_measured_once_then_read_from_the_cache(tmp_path):
    key = choice_key("avx2", 2, "llama:h576", AUTO)
    measure = CountingMeasure(timings(float32_on=(1.0, 0.02), float32_off=(1.1, 0.06)))
    first, first_cached = load_or_choose(str(tmp_path), key, AUTO, measure)
    second, second_cached = load_or_choose(str(tmp_path), key, AUTO, measure)
    assert (measure.calls, first_cached, second_cached) == (1, False, True)
    assert second == first


def test_another_machine_state_or_model_misses_the_cache(tmp_path, monkeypatch):
    key = choice_key("avx2", 2, "llama:h576", AUTO)
    measure = CountingMeasure(timings(float32_on=(1.0, 0.02), float32_off=(1.1, 0.06)))
    load_or_choose(str(tmp_path), key, AUTO, measure)
    others = [
        choice_key("avx2", 1, "llama:h576", AUTO),
        choice_key("avx2", 2, "llama:h2048", AUTO),
        choice_key("avx512_bf16", 2, "llama:h576", AUTO),
        choice_key("avx2", 2, "llama:h576", ComputeRequest("float32", "auto")),
    ]
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    others.append(choice_key("avx2", 2, "llama:h576", AUTO))
    assert len({other.file_name() for other in others} | {key.file_name()}) == len(others) + 1
    for other in others:
        assert not load_or_choose(str(tmp_path), other, AUTO, measure)[1]
    assert measure.calls == 1 + len(others)


def test_a_damaged_cache_file_is_measured_again(tmp_path):
    key = choice_key("avx2", 2, "llama:h576", AUTO)
    (tmp_path / key.file_name()).write_text("{not json")
    measure = CountingMeasure(timings(float32_on=(1.0, 0.02), float32_off=(1.1, 0.06)))
    choice, cached = load_or_choose(str(tmp_path), key, AUTO, measure)
    assert not cached and measure.calls == 1
    assert json.loads((tmp_path / key.file_name()).read_text())["choice"]["dtype"] == choice.dtype


def test_a_choice_survives_its_json_form():
    choice = choose_form(AUTO, timings(float32_on=(1.0, 0.02), float32_off=(1.1, 0.06)), 128)
    assert ComputeChoice.from_json(json.loads(json.dumps(choice.to_json()))) == choice


# -- options ------------------------------------------------------------------------------


def test_batch_invariant_takes_true_false_or_auto_and_names_itself_otherwise():
    assert ModelConfig().batch_invariant == "auto"
    for value in (True, False, "auto"):
        assert ModelConfig(batch_invariant=value).batch_invariant == value
    for value in ("on", 1, None):
        with pytest.raises(InvalidInputError, match="batch_invariant"):
            ModelConfig(batch_invariant=value)


# -- the probe ----------------------------------------------------------------------------


def test_probe_prefills_shrink_with_the_layer_and_stay_within_the_context():
    assert probe_tokens(TINY_ARCH, 4096) == 512
    eight_b = dataclasses.replace(
        TINY_ARCH, hidden_size=4096, intermediate_size=14336, num_heads=32, num_kv_heads=8
    )
    assert 16 <= probe_tokens(eight_b, 4096) < 64
    assert probe_tokens(TINY_ARCH, 100) == 100


def test_the_probe_times_every_candidate_of_this_cpu(native_kernels):
    if native_kernels is None:
        pytest.skip("no native kernels on this machine (no C compiler)")
    forms = candidate_forms(AUTO, cpu_computes_bf16())
    measured = measure_forms(forms, TINY_ARCH, None, native_kernels, AttentionConfig(), 64)
    assert [timing.form for timing in measured] == forms
    for timing in measured:
        assert math.isfinite(timing.prefill_s) and timing.prefill_s > 0
        assert math.isfinite(timing.decode_s) and timing.decode_s > 0
    choice = choose_form(AUTO, measured, 64)
    assert ComputeForm(choice.dtype, choice.batch_invariant) in forms


# -- an engine on a cached choice ---------------------------------------------------------


def _seed_choice(cache_dir: str, model_path: str, choice_timings: list[FormTiming], threads: int) -> None:
    """Write the choice these timings make into the cache an engine of default options reads."""
    from firsttoken.models.registry import open_checkpoint
    from firsttoken.ops.native import load_native_kernels
    from firsttoken.worker.compute_choice import write_cached
    from firsttoken.worker.compute_form import arch_shapes

    native = load_native_kernels(os.path.join(cache_dir, "native"))
    arch = open_checkpoint(model_path, cache_dir).arch
    key = choice_key(native.isa, threads, arch_shapes(arch), AUTO)
    path = os.path.join(cache_dir, "compute_choice", key.file_name())
    write_cached(path, key, choose_form(AUTO, choice_timings, 512).to_json())


def _cache_sharing_the_runs_builds(tmp_path) -> str:
    """A cache folder of this test's own choices and step costs, with the run's built kernels
    and converted weights linked in (nothing to build or convert again)."""
    from firsttoken.models.loaders.conversion_cache import default_cache_dir

    shared = default_cache_dir()
    os.makedirs(shared, exist_ok=True)
    for entry in os.listdir(shared):
        if entry not in ("compute_choice", "step_costs"):
            os.symlink(os.path.join(shared, entry), tmp_path / entry)
    return str(tmp_path)


@pytest.mark.parametrize(
    "choice_timings, expected",
    [
        (
            timings(
                float32_on=(1.0, 0.02),
                float32_off=(1.1, 0.06),
                bfloat16_on=(0.95, 0.03),
                bfloat16_off=(0.94, 0.03),
            ),
            ("float32", True),
        ),
        (
            timings(
                float32_on=(1.0, 0.02),
                float32_off=(1.1, 0.06),
                bfloat16_on=(0.5, 0.04),
                bfloat16_off=(0.5, 0.03),
            ),
            ("bfloat16", False),
        ),
    ],
    ids=["float32-invariant", "bf16-free"],
)
def test_an_engine_of_default_options_runs_the_cached_choice(
    model_path, tmp_path, native_kernels, choice_timings, expected
):
    if native_kernels is None or not cpu_computes_bf16():
        pytest.skip("needs native kernels and a CPU oneDNN has bf16 kernels for")
    from firsttoken import LLM

    cache_dir = _cache_sharing_the_runs_builds(tmp_path)
    _seed_choice(cache_dir, model_path, choice_timings, threads=1)
    llm = LLM(model_path, cache_dir=cache_dir, num_threads=1, adaptive_threads=False, chunk_size=256)
    try:
        dtype, invariant = expected
        assert llm.compute.dtype == dtype and llm.compute.batch_invariant == invariant
        assert llm.compute.start_up_choices[0].startswith(f"dtype auto: {dtype}")
        assert llm.core.worker.dtype == getattr(torch, dtype)
    finally:
        llm.shutdown()
