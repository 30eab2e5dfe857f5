"""How many CPU threads a step runs on, chosen from how fast steps actually run.

A parallel region is as slow as its slowest thread. With every core given a thread, one core
shared with another busy process makes its thread a straggler that every region of the step
waits for, descheduled for whole time slices: a 512-token prefill on 2 cores went from 150 ms
to ~400 ms beside one busy process, while on the one free core alone it takes ~290 ms. So the
governor watches each step's slowness (measured time over the calibrated prediction, ~1 when
the machine is quiet) and, when steps run slower than `contention_slowness` times what their
thread count explains, tries one thread fewer for a short window; it keeps whichever count ran
faster, and otherwise, below the full count, now and then tries one more thread, so that it
returns to every core once the other process is gone. On a quiet machine it never leaves the
full count.
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)


@dataclass
class _Window:
    """Slowness samples of consecutive steps run on one thread count."""

    threads: int
    slowness: list[float] = field(default_factory=list)
    seconds: float = 0.0

    def add(self, slowness: float, seconds: float) -> None:
        self.slowness.append(slowness)
        self.seconds += seconds

    def is_full(self, min_steps: int, min_seconds: float) -> bool:
        return len(self.slowness) >= min_steps and self.seconds >= min_seconds

    def median(self) -> float:
        return statistics.median(self.slowness)


class ThreadGovernor:
    """Owns the thread count of the next step and the measurements that choose it."""

    def __init__(
        self,
        max_threads: int,
        contention_slowness: float = 1.3,
        min_gain: float = 0.1,
        window_steps: int = 1,
        window_seconds: float = 0.1,
        reprobe_interval_s: float = 5.0,
    ) -> None:
        self.max_threads = max_threads
        self.contention_slowness = contention_slowness
        self.min_gain = min_gain
        self.window_steps = window_steps
        self.window_seconds = window_seconds
        self.reprobe_interval_s = reprobe_interval_s
        self.current_threads = max_threads
        self._settled = _Window(max_threads)
        self._settled_slowness: float | None = None
        self._probe: _Window | None = None
        self._last_probe_end = float("-inf")

    def threads(self) -> int:
        """The thread count the next step runs on."""
        return self._probe.threads if self._probe is not None else self.current_threads

    def observe(self, threads: int, seconds: float, predicted_seconds: float, now: float) -> None:
        """A step ran on `threads` threads in `seconds`; quiet, on every thread, it takes about
        `predicted_seconds`. `now`: a monotonic clock reading."""
        if predicted_seconds <= 0 or seconds <= 0 or threads != self.threads():
            return
        slowness = seconds / predicted_seconds
        if self._probe is not None:
            self._probe.add(slowness, seconds)
            if self._probe.is_full(self.window_steps, self.window_seconds):
                self._end_probe(now)
            return
        self._settled.add(slowness, seconds)
        if self._settled.is_full(self.window_steps, self.window_seconds):
            self._settled_slowness = self._settled.median()
            self._settled = _Window(self.current_threads)
            self._maybe_probe(now)

    def _maybe_probe(self, now: float) -> None:
        if now - self._last_probe_end < self.reprobe_interval_s:
            return
        # Steps are compute-bound: on fewer threads a quiet machine is this much slower.
        expected = self.max_threads / self.current_threads
        if self.current_threads > 1 and self._settled_slowness > self.contention_slowness * expected:
            self._probe = _Window(self.current_threads - 1)
        elif self.current_threads < self.max_threads:
            self._probe = _Window(self.current_threads + 1)

    def _end_probe(self, now: float) -> None:
        assert self._probe is not None and self._settled_slowness is not None
        if self._probe.median() < (1 - self.min_gain) * self._settled_slowness:
            logger.info(
                "steps now run on %d threads (%.2fx the quiet step time, %.2fx on %d)",
                self._probe.threads, self._probe.median(), self._settled_slowness, self.current_threads,
            )
            self.current_threads = self._probe.threads
            self._settled_slowness = self._probe.median()
            self._settled = _Window(self.current_threads)
        self._probe = None
        self._last_probe_end = now
