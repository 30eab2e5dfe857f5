"""What `firsttoken tune` says on stderr while it runs, which can be an hour: its size and least
duration before it starts, each setting as it starts (with the time the rest should take at the
pace so far), and each probe as it ends."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

from firsttoken.bench.tune import Probe, Setting, least_sending_s


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min"


class TuneProgress:
    def __init__(
        self,
        num_settings: int,
        max_probes: int,
        ttft_objective_ms: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.num_settings = num_settings
        self.max_probes = max_probes
        self.ttft_objective_ms = ttft_objective_ms
        self.clock = clock
        self._started_at = clock()
        self._probes_of_setting = 0

    def plan(self, num_prompts: int, output_len: int, start_rate: float) -> None:
        """The run's size, and the least time it takes: arrivals alone, before any server start
        or reply, since neither is known until a server runs."""
        per_setting_s = least_sending_s(num_prompts, start_rate, self.max_probes)
        self._say(
            f"tune: {self.num_settings} settings x up to {self.max_probes} rates x {num_prompts} prompts "
            f"(at most {self.num_settings * self.max_probes * num_prompts} requests, each up to "
            f"{self.ttft_objective_ms:g} ms to its first token then {output_len} tokens)"
        )
        self._say(
            f"tune: each setting starts a server, then sends for at least {_minutes(per_setting_s)} "
            f"({num_prompts} arrivals at {start_rate:g} req/s span {(num_prompts - 1) / start_rate:.0f} s, "
            f"half that at each doubled rate; a rate lost halves and takes longer): at least "
            f"{_minutes(self.num_settings * per_setting_s)} in all, plus the server starts"
        )

    def setting_started(self, index: int, setting: Setting) -> None:
        self._probes_of_setting = 0
        pace = ""
        if index > 0:
            elapsed_s = self.clock() - self._started_at
            left_s = elapsed_s / index * (self.num_settings - index)
            pace = f"; {_minutes(elapsed_s)} so far, about {_minutes(left_s)} left at this pace"
        self._say(f"[setting {index + 1}/{self.num_settings}] {setting.label}: starting a server{pace}")

    def probe_ended(self, setting: Setting, probe: Probe) -> None:
        self._probes_of_setting += 1
        verdict = "kept" if probe.keeps() else "lost"
        self._say(
            f"[{setting.label}] rate {self._probes_of_setting}/{self.max_probes}, {probe.rate:.3g} req/s: "
            f"TTFT P99 {probe.p99_ttft_ms:.0f} ms, {probe.num_within}/{probe.num_sent} within "
            f"{self.ttft_objective_ms:g} ms: {verdict}"
        )

    def _say(self, line: str) -> None:
        print(line, file=sys.stderr, flush=True)
