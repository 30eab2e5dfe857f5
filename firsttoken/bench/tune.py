"""`firsttoken tune`: the engine settings that serve a workload at the highest rate within a
TTFT objective.

For each setting of a search grid, a trial serves the workload at increasing Poisson rates: the
rate doubles while the objective holds (P99 TTFT of every request sent within the target, a
failed or refused request counting as a miss), then bisects between the last rate kept and the
first one lost. The setting with the highest rate kept is the best; ties go to the lower P99.
The search is pure: a trial is a function of (setting, rate), so it runs against a real server
(bench/server_process.py) or against a model of one in the tests.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from firsttoken.bench.serve_stats import RequestRecord
from firsttoken.bench.stats import summarize
from firsttoken.bench.table import format_table
from firsttoken.errors import InvalidInputError

# Requests of a probe that must meet the objective for its rate to be kept: the P in P99.
KEPT_SHARE = 0.99


@dataclass(frozen=True)
class Setting:
    """Engine options of one candidate (LLM(...) keywords); empty is the defaults."""

    options: tuple[tuple[str, Any], ...] = ()

    @property
    def as_dict(self) -> dict[str, Any]:
        return dict(self.options)

    @property
    def label(self) -> str:
        return " ".join(f"{name}={_shown(value)}" for name, value in self.options) or "defaults"


def _shown(value: Any) -> str:
    return "none" if value is None else str(value)


@dataclass(frozen=True)
class Probe:
    """The workload served at one rate on one setting."""

    rate: float
    num_sent: int
    num_within: int  # requests whose first token came within the objective
    p50_ttft_ms: float  # over the requests that succeeded (inf: none did)
    p99_ttft_ms: float  # over every request sent, a failure counting as infinitely late

    def keeps(self) -> bool:
        return self.num_sent > 0 and self.num_within >= KEPT_SHARE * self.num_sent


@dataclass
class SettingResult:
    setting: Setting
    probes: list[Probe] = field(default_factory=list)
    error: str | None = None  # why the setting could not be tried (it failed to start)

    @property
    def best_rate(self) -> float | None:
        """The highest rate kept; None if none was."""
        kept = [probe.rate for probe in self.probes if probe.keeps()]
        return max(kept) if kept else None

    def probe_at(self, rate: float) -> Probe:
        return next(probe for probe in self.probes if probe.rate == rate)


def probe_from_records(rate: float, records: Sequence[RequestRecord], ttft_objective_ms: float) -> Probe:
    """A probe's figures from what the client saw."""
    ttfts_ms = [record.ttft_s * 1000 if record.success else math.inf for record in records]
    served = [ttft for ttft in ttfts_ms if math.isfinite(ttft)]
    return Probe(
        rate=rate,
        num_sent=len(records),
        num_within=sum(1 for ttft in ttfts_ms if ttft <= ttft_objective_ms),
        p50_ttft_ms=summarize(served).median if served else math.inf,
        p99_ttft_ms=_p99_with_misses(ttfts_ms),
    )


def _p99_with_misses(ttfts_ms: list[float]) -> float:
    """The 99th percentile by rank (no interpolation toward an infinite miss)."""
    if not ttfts_ms:
        return math.inf
    ordered = sorted(ttfts_ms)
    return ordered[min(len(ordered) - 1, math.ceil(KEPT_SHARE * len(ordered)) - 1)]


def search_rate(measure: Callable[[float], Probe], start_rate: float, max_probes: int) -> list[Probe]:
    """Probes from `start_rate`: doubling while the objective holds, then bisecting (on a log
    scale) between the highest rate kept and the lowest lost, `max_probes` in all."""
    probes: list[Probe] = []
    kept_rate, lost_rate = 0.0, math.inf
    rate = start_rate
    while len(probes) < max_probes:
        probe = measure(rate)
        probes.append(probe)
        if probe.keeps():
            kept_rate = max(kept_rate, rate)
        else:
            lost_rate = min(lost_rate, rate)
        if math.isinf(lost_rate):
            rate = 2 * kept_rate
        elif kept_rate == 0.0:
            rate = lost_rate / 2
        else:
            rate = math.sqrt(kept_rate * lost_rate)
    return probes


def least_sending_s(num_prompts: int, start_rate: float, max_probes: int) -> float:
    """The least time a setting's search spends sending requests: a probe's Poisson arrivals span
    (num_prompts - 1) / rate on average (the first leaves at once), and the rate at most doubles
    from one probe to the next (a rate lost halves, or bisects below, which takes longer)."""
    return sum((num_prompts - 1) / (start_rate * 2**probe) for probe in range(max_probes))


def tune(
    settings: Sequence[Setting],
    trial: Callable[[Setting, float], Probe],
    start_rate: float,
    max_probes: int,
    on_probe: Callable[[Setting, Probe], None] = lambda setting, probe: None,
    on_setting: Callable[[int, Setting], None] = lambda index, setting: None,
) -> list[SettingResult]:
    """Search every setting's highest rate within the objective. A setting whose trial raises
    (its server would not start, say) is kept with the error and no probes."""
    results = []
    for index, setting in enumerate(settings):
        on_setting(index, setting)
        result = SettingResult(setting)

        def measure(rate: float, setting: Setting = setting, result: SettingResult = result) -> Probe:
            probe = trial(setting, rate)
            result.probes.append(probe)
            on_probe(setting, probe)
            return probe

        try:
            search_rate(measure, start_rate, max_probes)
        except (RuntimeError, ValueError, OSError) as error:
            result.error = str(error)
        results.append(result)
    return results


def best_result(results: Sequence[SettingResult]) -> SettingResult | None:
    """The setting with the highest rate kept (the lower P99 there on a tie); None if none kept any."""
    ranked = [result for result in results if result.best_rate is not None]
    if not ranked:
        return None

    def rank(result: SettingResult) -> tuple[float, float]:
        rate = result.best_rate
        assert rate is not None
        return (-rate, result.probe_at(rate).p99_ttft_ms)

    return min(ranked, key=rank)


def parse_search(pairs: Sequence[str]) -> list[Setting]:
    """The grid of `NAME=V1,V2 ...` pairs (values as JSON where they parse, `none` for the
    default, else text), every combination, in order."""
    axes: list[list[tuple[str, Any]]] = []
    for pair in pairs:
        name, sign, values = pair.partition("=")
        if not sign or not name or not values:
            raise InvalidInputError("search", f"{pair!r}: give NAME=VALUE[,VALUE...]")
        axes.append([(name, _search_value(value)) for value in values.split(",")])
    return [Setting(tuple(combination)) for combination in itertools.product(*axes)]


def _search_value(text: str) -> Any:
    if text.lower() in ("none", "null"):
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def format_results(results: Sequence[SettingResult], ttft_objective_ms: float) -> str:
    rows = []
    for result in results:
        rate = result.best_rate
        if result.error is not None:
            rows.append([result.setting.label, "-", "-", "-", f"failed: {result.error[:60]}"])
        elif rate is None:
            rows.append([result.setting.label, "none kept", "-", "-", ""])
        else:
            probe = result.probe_at(rate)
            rows.append([result.setting.label, rate, probe.p50_ttft_ms, probe.p99_ttft_ms, ""])
    header = ["setting", "highest rate kept (req/s)", "TTFT P50 (ms)", "TTFT P99 (ms)", "note"]
    return f"TTFT objective: P99 <= {ttft_objective_ms:g} ms\n" + format_table(header, rows)


def results_payload(results: Sequence[SettingResult], ttft_objective_ms: float) -> dict[str, Any]:
    return {
        "ttft_p99_objective_ms": ttft_objective_ms,
        "settings": [
            {
                "options": result.setting.as_dict,
                "highest_rate_kept": result.best_rate,
                "error": result.error,
                "probes": [probe.__dict__ for probe in result.probes],
            }
            for result in results
        ],
    }
