"""Whether other work took the CPUs the engine's threads needed while it timed something.

The engine times its candidates at start (dtype, invariance, attention kernels, step costs) and
caches what it chose. Timed beside a compiler or another engine, every candidate runs 2-3x slow
and unevenly, and the choice made from those timings would be cached for every later start: on a
2-core Zen 3, a start beside a two-job build measured the row-invariant decode step at 484 ms
against 196 (quiet: 51 against 63) and switched invariance off for good. So each measurement
is watched: the CPU time the whole machine spent (the kernel's /proc/stat, steal included: a
hypervisor giving the vCPU away is contention too) less this process's own is what others
took. The CPUs the measurement's threads leave free are theirs to take; beyond those, others
taking more than `OTHERS_MAX_SHARE` of the threads' CPUs marks the measurement disturbed. A
disturbed measurement is used for the run that made it but not cached: the next start
measures again.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

logger = logging.getLogger(__name__)
Result = TypeVar("Result")

# Others may take this share of the measuring threads' CPUs before a measurement counts as
# disturbed: a quiet machine's daemons and the kernel's own threads take well under it.
OTHERS_MAX_SHARE = 0.2
# Below this, /proc/stat's clock ticks (10 ms a CPU) are too coarse to tell a share.
MIN_WATCHED_S = 0.25
_PROC_STAT = "/proc/stat"
# /proc/stat's cpu line: user nice system idle iowait irq softirq steal guest guest_nice, in
# clock ticks. guest and guest_nice are already counted in user and nice.
_IDLE_FIELDS = (3, 4)
_COUNTED_FIELDS = 8


@dataclass(frozen=True)
class CpuSample:
    """The machine's and this process's CPU time at one moment."""

    wall_s: float
    machine_busy_s: float
    machine_cpus: int
    own_s: float


@dataclass(frozen=True)
class Contention:
    """What others took between two samples, against what the measuring threads left free."""

    others_cpus: float  # the CPUs others kept busy, on average
    machine_cpus: int
    threads: int

    @property
    def taken_share(self) -> float:
        """The share of the threads' CPUs others took: what they used beyond the free CPUs."""
        free_cpus = max(0, self.machine_cpus - self.threads)
        return min(1.0, max(0.0, self.others_cpus - free_cpus) / max(1, self.threads))

    @property
    def busy(self) -> bool:
        return self.taken_share > OTHERS_MAX_SHARE

    def describe(self) -> str:
        return (
            f"other work kept {self.others_cpus:.1f} of {self.machine_cpus} CPUs busy while it was measured "
            f"on {self.threads} threads"
        )


def read_proc_stat() -> str | None:
    try:
        with open(_PROC_STAT, encoding="ascii") as handle:
            return handle.read()
    except OSError:
        return None


def sample_cpu(read_stat: Callable[[], str | None] = read_proc_stat) -> CpuSample | None:
    """Now's sample; None where the system does not report its CPU time (not Linux)."""
    text = read_stat()
    if text is None:
        return None
    lines = text.splitlines()
    total = next((line.split() for line in lines if line.startswith("cpu ")), None)
    if total is None:
        return None
    ticks = [int(value) for value in total[1 : 1 + _COUNTED_FIELDS]]
    busy_ticks = sum(value for index, value in enumerate(ticks) if index not in _IDLE_FIELDS)
    cpus = sum(1 for line in lines if line.startswith("cpu") and line[3:4].isdigit())
    own = os.times()
    return CpuSample(
        wall_s=time.monotonic(),
        machine_busy_s=busy_ticks / os.sysconf("SC_CLK_TCK"),
        machine_cpus=max(1, cpus),
        own_s=own.user + own.system,
    )


def contention_between(before: CpuSample | None, after: CpuSample | None, threads: int) -> Contention | None:
    """What others took from `before` to `after` beside `threads` measuring threads; None where
    unknown (no samples, or too short a span to tell)."""
    if before is None or after is None:
        return None
    watched_s = after.wall_s - before.wall_s
    if watched_s < MIN_WATCHED_S:
        return None
    others_s = (after.machine_busy_s - before.machine_busy_s) - (after.own_s - before.own_s)
    others_cpus = min(float(after.machine_cpus), max(0.0, others_s / watched_s))
    return Contention(others_cpus, after.machine_cpus, threads)


class ContentionWatch:
    """Samples the CPUs around a measurement on `threads` threads: `with ContentionWatch(threads)
    as watch: ...`, then `watch.contention` (None where the system does not tell) and
    `watch.disturbed`."""

    def __init__(self, threads: int, read_stat: Callable[[], str | None] | None = None) -> None:
        self._threads = threads
        self._read_stat = read_stat or read_proc_stat
        self._before: CpuSample | None = None
        self.contention: Contention | None = None

    def __enter__(self) -> ContentionWatch:
        self._before = sample_cpu(self._read_stat)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.contention = contention_between(self._before, sample_cpu(self._read_stat), self._threads)

    @property
    def disturbed(self) -> bool:
        return self.contention is not None and self.contention.busy


def measured_for_cache(
    what: str, measure: Callable[[], Result], threads: int, read_stat: Callable[[], str | None] | None = None
) -> tuple[Result, bool]:
    """`measure()`'s result and whether it may be cached: False where other work disturbed it
    (said in the log, naming `what`), measuring on `threads` threads. `read_stat`: the machine's
    CPU times (default /proc/stat)."""
    with ContentionWatch(threads, read_stat) as watch:
        result = measure()
    if watch.disturbed:
        logger.warning(
            "%s: %s; used for this run only, not cached: the next start measures again",
            what,
            watch.contention.describe(),
        )
    return result, not watch.disturbed
