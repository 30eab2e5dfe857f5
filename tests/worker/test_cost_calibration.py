"""A cached step cost model is trusted only while it predicts a fresh probe step."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest
import torch

from firsttoken.core.cost_model import StepCostModel
from firsttoken.worker import cost_calibration
from firsttoken.worker.cost_calibration import (
    CALIBRATION_VERSION,
    CalibrationLimits,
    calibration_shapes,
    load_or_calibrate,
    probe_shape,
)
from firsttoken.worker.cpu_contention import MIN_WATCHED_S
from firsttoken.worker.startup import step_cost_cache_name

MACHINE_NOW = StepCostModel(seconds_fixed=0.02, seconds_per_token=2e-4, seconds_per_attention_pair=1e-7)
REFITTED = StepCostModel(seconds_fixed=0.03, seconds_per_token=3e-4, seconds_per_attention_pair=2e-7)


@pytest.fixture
def machine(monkeypatch):
    """Steps take what MACHINE_NOW predicts; calibrating returns REFITTED and is counted."""
    calls = {"calibrate": 0}

    def measure(runner, shape, limits, repeats=2):
        return MACHINE_NOW.predict(*shape.work)

    def calibrate(runner, limits):
        calls["calibrate"] += 1
        return REFITTED

    monkeypatch.setattr(cost_calibration, "measure", measure)
    monkeypatch.setattr(cost_calibration, "calibrate", calibrate)
    return calls


def _limits(
    max_batched_tokens: int, capacity_tokens: int, max_model_len: int = 8192, vocab_size: int = 49152
):
    return CalibrationLimits(1, capacity_tokens, max_batched_tokens, max_model_len, vocab_size)


def _store(path, model: StepCostModel) -> None:
    path.write_text(json.dumps({"version": CALIBRATION_VERSION, **model.__dict__}))


def test_a_cached_model_that_still_predicts_the_probe_is_used(tmp_path, machine):
    cache_file = tmp_path / "costs.json"
    close = MACHINE_NOW.scaled(1.5)
    _store(cache_file, close)
    assert load_or_calibrate(None, _limits(2048, 65536), str(cache_file), 2) == close
    assert machine["calibrate"] == 0


def test_a_cached_model_from_a_busy_machine_is_measured_again(tmp_path, machine):
    cache_file = tmp_path / "costs.json"
    _store(cache_file, MACHINE_NOW.scaled(60))  # calibrated while something else ran
    assert load_or_calibrate(None, _limits(2048, 65536), str(cache_file), 2) == REFITTED
    assert machine["calibrate"] == 1
    assert json.loads(cache_file.read_text())["seconds_fixed"] == REFITTED.seconds_fixed


def test_without_a_cache_the_model_is_measured_and_saved(tmp_path, machine):
    cache_file = tmp_path / "sub" / "costs.json"
    assert load_or_calibrate(None, _limits(2048, 65536), str(cache_file), 2) == REFITTED
    assert cache_file.exists()


def test_probe_is_a_small_fresh_prefill_within_capacity():
    assert probe_shape(_limits(2048, 65536)).chunks == ((0, 256),)
    assert probe_shape(_limits(2048, 300)).chunks == ((0, 150),)
    assert probe_shape(_limits(8, 65536)).chunks == ((0, 8),)


@pytest.mark.parametrize("max_model_len", [8, 256, 512, 1024, 2048])
def test_no_calibration_step_reaches_past_the_context_length(max_model_len):
    for shape in calibration_shapes(_limits(2048, 65536, max_model_len=max_model_len)):
        assert all(start + count <= max_model_len for start, count in shape.chunks), shape


def test_calibration_token_ids_are_in_a_small_vocabulary():
    limits = _limits(2048, 65536, vocab_size=300)
    for shape in calibration_shapes(limits):
        output = cost_calibration._scheduler_output(shape, limits)
        assert all(0 <= token < 300 for chunk in output.chunks for token in chunk.token_ids)


def _worker(
    quantization: str | None, native_isa: str | None, batch_invariant: bool = True
) -> SimpleNamespace:
    """What the cache name reads of a worker."""
    return SimpleNamespace(
        compute=SimpleNamespace(batch_invariant=batch_invariant),
        num_threads=2,
        device=torch.device("cpu"),
        tensor_parallel_size=1,
        dtype=torch.float32,
        checkpoint=SimpleNamespace(fingerprint="model"),
        config=SimpleNamespace(
            model_config=SimpleNamespace(quantization=quantization), cache=SimpleNamespace(block_size=16)
        ),
        kernels=SimpleNamespace(native=SimpleNamespace(isa=native_isa) if native_isa else None),
    )


def test_engines_whose_steps_differ_keep_their_own_step_costs():
    """int4 and float engines of one model (their probe prefills cost the same), builds of
    different kernels and engines with and without batch invariance each measure their own model."""
    names = {
        step_cost_cache_name(_worker(quantization, isa, invariant))
        for quantization in (None, "int4", "int8")
        for isa in ("avx2", "avx512", None)
        for invariant in (True, False)
    }
    assert len(names) == 18


def test_calibration_times_each_step_twice_but_a_long_prefill_once():
    executed_prefills = []
    runner = SimpleNamespace(
        execute=lambda output: executed_prefills.extend(
            len(chunk.token_ids) for chunk in output.chunks if len(output.chunks) == 1
        )
    )
    cost_calibration.calibrate(runner, _limits(2048, 65536))
    assert executed_prefills.count(1024) == 1
    assert [executed_prefills.count(size) for size in (16, 64)] == [2, 2]


def test_calibration_prices_decode_rows_and_their_pairs_apart_from_a_prefills():
    """Steps that take a fixed cost, prices per token and per prefill pair, and a decode row's
    own price and ten times the pair's: the fit finds each, from decode batches of two sizes
    and two contexts."""
    truth = StepCostModel(0.02, 2e-4, 1e-7, seconds_per_decode_row=1e-3, seconds_per_decode_pair=1e-6)
    shapes = calibration_shapes(_limits(2048, 65536))
    decode_batches = {(len(shape.chunks), shape.chunks[0][0]) for shape in shapes if shape.work[2]}
    assert len(decode_batches) == 3
    fitted = cost_calibration.fit(shapes, [truth.predict(*shape.work) for shape in shapes])
    for name in ("seconds_fixed", "seconds_per_token", "seconds_per_attention_pair"):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=1e-6)
    assert fitted.seconds_per_decode_row == pytest.approx(1e-3, rel=1e-6)
    assert fitted.seconds_per_decode_pair == pytest.approx(1e-6, rel=1e-6)


def test_calibration_measures_a_lone_decode_apart_from_the_fit():
    executed_rows = []
    runner = SimpleNamespace(
        execute=lambda output: executed_rows.append([len(c.token_ids) for c in output.chunks])
    )
    model = cost_calibration.calibrate(runner, _limits(2048, 65536))
    assert executed_rows.count([1]) == 3  # the lone decode, fastest of three
    assert model.seconds_one_decode > 0
    assert cost_calibration.one_decode_shape(_limits(2048, 100, max_model_len=64)).chunks == ((63, 1),)


def _disturbed_calibration(monkeypatch, machine):
    """Calibrating takes long enough to be judged, while other work takes every CPU."""
    busy_ticks = iter(range(5000, 10**9, 10_000))

    def busy_stat():
        per_cpu = "cpu0 1 0 1 1 0 0 0 0 0 0\ncpu1 1 0 1 1 0 0 0 0 0 0\n"
        return f"cpu  {next(busy_ticks)} 0 0 1000 0 0 0 0 0 0\n{per_cpu}"

    def slow_calibrate(runner, limits):
        machine["calibrate"] += 1
        time.sleep(MIN_WATCHED_S + 0.05)
        return REFITTED

    monkeypatch.setattr(cost_calibration, "calibrate", slow_calibrate)
    return busy_stat


def test_a_disturbed_calibration_keeps_the_quietly_measured_cache(tmp_path, machine, monkeypatch):
    cache_file = tmp_path / "costs.json"
    quiet = MACHINE_NOW.scaled(60)  # mispredicts the probe: measured again
    _store(cache_file, quiet)
    busy_stat = _disturbed_calibration(monkeypatch, machine)
    assert load_or_calibrate(None, _limits(2048, 65536), str(cache_file), 2, busy_stat) == quiet
    assert machine["calibrate"] == 1
    assert json.loads(cache_file.read_text())["seconds_fixed"] == quiet.seconds_fixed


def test_without_a_cache_a_disturbed_calibration_is_used_but_not_saved(tmp_path, machine, monkeypatch):
    cache_file = tmp_path / "costs.json"
    busy_stat = _disturbed_calibration(monkeypatch, machine)
    assert load_or_calibrate(None, _limits(2048, 65536), str(cache_file), 2, busy_stat) == REFITTED
    assert not cache_file.exists()
