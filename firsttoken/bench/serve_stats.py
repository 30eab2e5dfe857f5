"""Serving metrics from what a client saw, with the definitions of `vllm bench serve`.

TTFT: send -> first chunk with content. ITL: the gaps between content chunks.
TPOT: (latency - TTFT) / (output tokens - 1). E2E: send -> last content chunk.
Goodput: requests that meet every SLO, per second of the run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from firsttoken.bench.stats import Distribution, summarize
from firsttoken.errors import InvalidInputError


@dataclass
class RequestRecord:
    """What the client saw of one request; times in seconds, `start_s` from the run's start."""

    start_s: float
    num_prompt_tokens: int
    success: bool = False
    ttft_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    latency_s: float = 0.0
    num_output_tokens: int = 0
    error: str = ""

    @property
    def tpot_s(self) -> float | None:
        """None for a request with one output token: it has no decode to time."""
        if self.num_output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.num_output_tokens - 1)

    def chunk_times_s(self) -> list[float]:
        """Arrival time of each content chunk after the first, from the run's start."""
        times, now = [], self.start_s + self.ttft_s
        for gap in self.itl_s:
            now += gap
            times.append(now)
        return times


@dataclass(frozen=True)
class SLO:
    """Latency targets a request must all meet to count towards goodput, in ms (None: no target)."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    @classmethod
    def from_goodput_args(cls, pairs: Sequence[str]) -> SLO:
        """From `vllm bench serve --goodput` pairs (`ttft:500 tpot:100 e2el:2000`, in ms): only
        the objectives named count."""
        names = {"ttft": "ttft_ms", "tpot": "tpot_ms", "e2el": "e2e_ms"}
        limits: dict[str, float] = {}
        for pair in pairs:
            name, _, value = pair.partition(":")
            if name not in names:
                raise InvalidInputError("goodput", f"{pair!r}: the objective is one of ttft, tpot, e2el")
            try:
                limit = float(value)
            except ValueError:
                limit = -1.0
            if not limit > 0:
                raise InvalidInputError("goodput", f"{pair!r}: give the objective as NAME:MS with MS > 0")
            limits[names[name]] = limit
        return cls(**limits)

    def is_met_by(self, record: RequestRecord) -> bool:
        if not record.success:
            return False
        tpot = record.tpot_s
        return (
            _within(record.ttft_s, self.ttft_ms)
            and (tpot is None or _within(tpot, self.tpot_ms))
            and _within(record.latency_s, self.e2e_ms)
        )


def _within(seconds: float, limit_ms: float | None) -> bool:
    return limit_ms is None or seconds * 1000 <= limit_ms


@dataclass(frozen=True)
class ServeSummary:
    """The numbers a serving run is judged by; latencies in ms, throughputs per second."""

    duration_s: float
    num_completed: int
    num_failed: int
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    # Requests per second as the client sent them (a Poisson schedule of 30 requests at a
    # nominal rate of 3 can arrive at 4.3): what the achieved throughput is to be held against.
    offered_rate: float | None
    output_token_throughput: float
    total_token_throughput: float
    goodput: float
    # Of the successful requests, the share that met every objective (None: none succeeded).
    slo_attainment: float | None
    ttft_ms: Distribution
    tpot_ms: Distribution
    itl_ms: Distribution
    e2e_ms: Distribution

    def to_dict(self) -> dict[str, object]:
        plain = {name: getattr(self, name) for name in self.__dataclass_fields__}
        return {
            name: value.to_dict() if isinstance(value, Distribution) else value
            for name, value in plain.items()
        }


def sent_rate(records: Sequence[RequestRecord]) -> float | None:
    """Requests per second between the first send and the last; None for fewer than two."""
    starts = sorted(record.start_s for record in records)
    if len(starts) < 2 or starts[-1] <= starts[0]:
        return None
    return (len(starts) - 1) / (starts[-1] - starts[0])


def summarize_run(records: Sequence[RequestRecord], duration_s: float, slo: SLO) -> ServeSummary:
    """Statistics over the successful requests; throughputs over the whole run's duration."""
    done = [record for record in records if record.success]
    input_tokens = sum(record.num_prompt_tokens for record in done)
    output_tokens = sum(record.num_output_tokens for record in done)
    tpots = [tpot for tpot in (record.tpot_s for record in done) if tpot is not None]
    num_met = sum(1 for record in done if slo.is_met_by(record))
    return ServeSummary(
        duration_s=duration_s,
        num_completed=len(done),
        num_failed=len(records) - len(done),
        total_input_tokens=input_tokens,
        total_output_tokens=output_tokens,
        request_throughput=len(done) / duration_s,
        offered_rate=sent_rate(records),
        output_token_throughput=output_tokens / duration_s,
        total_token_throughput=(input_tokens + output_tokens) / duration_s,
        goodput=num_met / duration_s,
        slo_attainment=num_met / len(done) if done else None,
        ttft_ms=summarize([record.ttft_s for record in done]).scaled(1000),
        tpot_ms=summarize(tpots).scaled(1000),
        itl_ms=summarize([gap for record in done for gap in record.itl_s]).scaled(1000),
        e2e_ms=summarize([record.latency_s for record in done]).scaled(1000),
    )
