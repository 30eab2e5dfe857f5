"""How a serving run is shown: a summary table on the terminal and a JSON record on disk."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from firsttoken.bench.serve_client import LoadShape, ServeRun, ServeTarget
from firsttoken.bench.serve_stats import SLO, ServeSummary
from firsttoken.bench.table import format_table


def format_serve_summary(summary: ServeSummary, slo: SLO) -> str:
    targets = ", ".join(
        f"{name} <= {limit:g} ms"
        for name, limit in (("TTFT", slo.ttft_ms), ("TPOT", slo.tpot_ms), ("E2E", slo.e2e_ms))
        if limit is not None
    )
    totals = [
        ["successful requests", summary.num_completed],
        ["failed requests", summary.num_failed],
        ["duration (s)", summary.duration_s],
        ["input tokens", summary.total_input_tokens],
        ["output tokens", summary.total_output_tokens],
        ["offered rate, as sent (req/s)", "-" if summary.offered_rate is None else summary.offered_rate],
        ["request throughput (req/s)", summary.request_throughput],
        [f"goodput (req/s, {targets or 'no SLO'})", summary.goodput],
        ["SLO attainment (of successful)", "-" if summary.slo_attainment is None else summary.slo_attainment],
        ["output token throughput (tok/s)", summary.output_token_throughput],
        ["total token throughput (tok/s)", summary.total_token_throughput],
    ]
    latencies = [
        [name, dist.mean, dist.median, dist.p90, dist.p99]
        for name, dist in (
            ("TTFT", summary.ttft_ms),
            ("TPOT", summary.tpot_ms),
            ("ITL", summary.itl_ms),
            ("E2E", summary.e2e_ms),
        )
    ]
    return (
        format_table(["", "value"], totals)
        + "\n\n"
        + format_table(["ms", "mean", "median", "P90", "P99"], latencies)
    )


def serve_payload(
    target: ServeTarget,
    shape: LoadShape,
    dataset: dict[str, Any],
    slo: SLO,
    run: ServeRun,
    summary: ServeSummary,
) -> dict[str, Any]:
    """Everything needed to compare or re-plot a run later: settings, summary, every request."""
    return {
        "target": dataclasses.asdict(target),
        # JSON has no infinity: an unlimited rate is written as the string "inf".
        "load": {
            **dataclasses.asdict(shape),
            "request_rate": shape.request_rate if math.isfinite(shape.request_rate) else "inf",
        },
        "dataset": dataset,
        "slo_ms": dataclasses.asdict(slo),
        "model": run.model,
        "summary": summary.to_dict(),
        "server_counters": None if run.server_counters is None else dataclasses.asdict(run.server_counters),
        "requests": [dataclasses.asdict(record) for record in run.records],
    }
