"""Start-up measurements watched for other work: /proc/stat read, others' share judged against the
CPUs the measuring threads leave free, and a disturbed measurement used but not cached."""

from __future__ import annotations

import json
import time

import pytest

from firsttoken.worker import cpu_contention
from firsttoken.worker.compute_choice import (
    ComputeForm,
    ComputeRequest,
    FormTiming,
    choice_key,
    load_or_choose,
)
from firsttoken.worker.cpu_contention import (
    MIN_WATCHED_S,
    OTHERS_MAX_SHARE,
    Contention,
    CpuSample,
    contention_between,
    measured_for_cache,
    sample_cpu,
)

AUTO = ComputeRequest("auto", "auto")


def proc_stat(busy_ticks: int, idle_ticks: int = 1000, cpus: int = 2) -> str:
    """A /proc/stat whose cpu line has `busy_ticks` split over user, system and steal."""
    user, system, steal = busy_ticks // 2, busy_ticks // 4, busy_ticks - busy_ticks // 2 - busy_ticks // 4
    lines = [f"cpu  {user} 0 {system} {idle_ticks} 7 0 0 {steal} 99 0"]
    lines += [f"cpu{index} 1 0 1 1 0 0 0 0 0 0" for index in range(cpus)]
    return "\n".join([*lines, "intr 12345", "ctxt 678"]) + "\n"


class FakeStat:
    """/proc/stat that moves on by `busy_step` ticks each time it is read."""

    def __init__(self, busy_step: int) -> None:
        self.busy_ticks = 5000
        self.busy_step = busy_step

    def __call__(self) -> str:
        text = proc_stat(self.busy_ticks)
        self.busy_ticks += self.busy_step
        return text


def test_a_sample_counts_steal_and_not_idle_or_guest_time():
    sample = sample_cpu(lambda: proc_stat(busy_ticks=300, cpus=4))
    assert sample.machine_cpus == 4
    assert sample_cpu(lambda: proc_stat(busy_ticks=0)).machine_busy_s == 0
    assert sample.machine_busy_s == pytest.approx(300 / cpu_contention.os.sysconf("SC_CLK_TCK"))


def test_no_proc_stat_means_no_judgement():
    assert sample_cpu(lambda: None) is None
    assert contention_between(None, sample_cpu(lambda: proc_stat(5)), threads=2) is None


def _samples(others_cpus: float, own_cpus: float, seconds: float = 2.0, cpus: int = 2):
    before = CpuSample(wall_s=10.0, machine_busy_s=100.0, machine_cpus=cpus, own_s=50.0)
    after = CpuSample(
        wall_s=10.0 + seconds,
        machine_busy_s=100.0 + (others_cpus + own_cpus) * seconds,
        machine_cpus=cpus,
        own_s=50.0 + own_cpus * seconds,
    )
    return before, after


def test_others_on_the_threads_cpus_disturb_a_measurement():
    contention = contention_between(*_samples(others_cpus=1.0, own_cpus=1.0), threads=2)
    assert contention.others_cpus == pytest.approx(1.0)
    assert contention.taken_share == pytest.approx(0.5) and contention.busy
    assert "1.0 of 2 CPUs" in contention.describe()


def test_a_quiet_machine_does_not():
    contention = contention_between(*_samples(others_cpus=0.1, own_cpus=2.0), threads=2)
    assert contention.taken_share == pytest.approx(0.05) and not contention.busy


def test_others_on_the_cpus_the_threads_leave_free_do_not():
    # Two test workers on two CPUs, one thread each: each sees the other keep one CPU busy.
    assert not contention_between(*_samples(others_cpus=1.0, own_cpus=1.0), threads=1).busy
    assert contention_between(*_samples(others_cpus=1.9, own_cpus=1.0), threads=1).busy


def test_the_bound_is_the_stated_share():
    at_bound = Contention(others_cpus=2 * OTHERS_MAX_SHARE, machine_cpus=2, threads=2)
    above = Contention(others_cpus=2 * OTHERS_MAX_SHARE + 0.01, machine_cpus=2, threads=2)
    assert not at_bound.busy and above.busy


def test_too_short_a_span_is_not_judged():
    before, after = _samples(others_cpus=2.0, own_cpus=0.0, seconds=MIN_WATCHED_S / 2)
    assert contention_between(before, after, threads=2) is None


def _slow(result):
    def measure():
        time.sleep(MIN_WATCHED_S + 0.05)
        return result

    return measure


def test_a_disturbed_measurement_is_returned_but_not_cacheable(caplog):
    # Others' ticks over the sleep far exceed two CPUs' worth: the whole machine was theirs.
    result, cacheable = measured_for_cache("the probe", _slow(42), 2, FakeStat(busy_step=10_000))
    assert result == 42 and not cacheable
    assert "the probe: other work kept 2.0 of 2 CPUs busy" in caplog.text and "not cached" in caplog.text


def test_a_quiet_measurement_is_cacheable(caplog):
    result, cacheable = measured_for_cache("the probe", _slow(42), 2, FakeStat(busy_step=0))
    assert result == 42 and cacheable and "not cached" not in caplog.text


def test_a_compute_choice_measured_on_a_busy_machine_is_not_cached(tmp_path):
    key = choice_key("avx2", 2, "llama:h576", AUTO)
    timings = [
        FormTiming(ComputeForm("float32", True), 1.0, 0.02),
        FormTiming(ComputeForm("float32", False), 1.1, 0.06),
    ]
    calls = []

    def measure():
        calls.append(1)
        return _slow((timings, 512))()

    busy_choice, cached = load_or_choose(str(tmp_path), key, AUTO, measure, FakeStat(busy_step=10_000))
    assert not cached and not (tmp_path / key.file_name()).exists()
    quiet_choice, cached = load_or_choose(str(tmp_path), key, AUTO, measure, FakeStat(busy_step=0))
    assert not cached and quiet_choice == busy_choice and len(calls) == 2
    assert json.loads((tmp_path / key.file_name()).read_text())["choice"]["dtype"] == quiet_choice.dtype
    assert load_or_choose(str(tmp_path), key, AUTO, measure, FakeStat(busy_step=10_000))[1]
