"""Serving overhead as one number: a load run's latencies beside the same engine's own figures.

After a run, the model is loaded in this process and timed offline on the run's shape: TTFT of
one fresh prompt of the run's input length alone, and the decode step (TPOT) of a batch as large
as the run's mean concurrency. Served / offline is then what queueing, batching with other
requests and the HTTP path cost.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from firsttoken.bench.latency import LatencySpec, measure_latency
from firsttoken.bench.serve_stats import RequestRecord, ServeSummary
from firsttoken.bench.table import format_table
from firsttoken.engine import LLM

# Decode tokens a baseline batch generates: enough steps for a stable per-token time.
_BASELINE_DECODE_TOKENS = 32


@dataclass(frozen=True)
class OfflineBaseline:
    """The engine's own figures on a run's shape, in ms."""

    input_len: int
    decode_batch_size: int
    ttft_ms: float
    tpot_ms: float | None


def mean_concurrency(records: Sequence[RequestRecord], duration_s: float) -> float:
    """Requests in flight on average: the successful requests' latencies over the run's duration."""
    if duration_s <= 0:
        return 0.0
    return sum(record.latency_s for record in records if record.success) / duration_s


def measure_offline_baseline(
    llm: LLM, input_len: int, decode_batch_size: int, runs: int = 5
) -> OfflineBaseline:
    """Median TTFT of a lone prompt and median TPOT of a batch of `decode_batch_size` prompts."""
    alone = measure_latency(llm, LatencySpec(input_len=input_len, output_len=1, batch_size=1, runs=runs))
    batched = measure_latency(
        llm,
        LatencySpec(
            input_len=input_len,
            output_len=_BASELINE_DECODE_TOKENS,
            batch_size=decode_batch_size,
            runs=max(1, runs // 2),
            seed=1,
        ),
    )
    tpots = [run.tpot_s for run in batched if run.tpot_s is not None]
    return OfflineBaseline(
        input_len=input_len,
        decode_batch_size=decode_batch_size,
        ttft_ms=statistics.median(run.ttft_s for run in alone) * 1000,
        tpot_ms=statistics.median(tpots) * 1000 if tpots else None,
    )


def overhead_rows(summary: ServeSummary, baseline: OfflineBaseline) -> list[list[object]]:
    """[figure, served ms, offline ms, served / offline] for TTFT P50 and P99 and mean TPOT."""
    rows: list[list[object]] = [
        ["TTFT P50", summary.ttft_ms.median, baseline.ttft_ms, summary.ttft_ms.median / baseline.ttft_ms],
        ["TTFT P99", summary.ttft_ms.p99, baseline.ttft_ms, summary.ttft_ms.p99 / baseline.ttft_ms],
    ]
    if baseline.tpot_ms:
        rows.append(
            ["TPOT mean", summary.tpot_ms.mean, baseline.tpot_ms, summary.tpot_ms.mean / baseline.tpot_ms]
        )
    return rows


def format_overhead(summary: ServeSummary, baseline: OfflineBaseline) -> str:
    title = (
        f"served vs offline (TTFT: one {baseline.input_len}-token prompt alone; "
        f"TPOT: a batch of {baseline.decode_batch_size}, the run's mean concurrency)"
    )
    return (
        title
        + "\n\n"
        + format_table(["", "served ms", "offline ms", "ratio"], overhead_rows(summary, baseline))
    )
