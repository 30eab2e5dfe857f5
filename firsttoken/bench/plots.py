"""PNG plots of a serving run (TTFT CDF, TTFT and ITL over time, per-request timeline) and of a
tuning run (TTFT P99 by rate, per setting).

Figures are built with matplotlib's object API on the Agg canvas: no pyplot state, no display.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from firsttoken.bench.serve_stats import RequestRecord
from firsttoken.bench.tune import SettingResult


def write_plots(records: Sequence[RequestRecord], path_stem: str) -> list[str]:
    """Write the three plots as `<path_stem>_<name>.png`; returns their paths."""
    done = [record for record in records if record.success]
    figures = {
        "ttft_cdf": ttft_cdf_figure(done),
        "latency_over_time": latency_over_time_figure(done),
        "timeline": timeline_figure(done),
    }
    paths = []
    for name, figure in figures.items():
        path = f"{path_stem}_{name}.png"
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        FigureCanvasAgg(figure).print_png(path)
        paths.append(path)
    return paths


def ttft_cdf_figure(records: Sequence[RequestRecord]) -> Figure:
    figure = Figure(figsize=(7, 4.5), layout="constrained")
    axes = figure.add_subplot()
    ttfts = sorted(record.ttft_s * 1000 for record in records)
    fractions = [(index + 1) / len(ttfts) for index in range(len(ttfts))]
    axes.step(ttfts, fractions, where="post")
    axes.set(xlabel="TTFT (ms)", ylabel="fraction of requests", title="TTFT CDF", ylim=(0, 1.02))
    axes.grid(alpha=0.3)
    return figure


def latency_over_time_figure(records: Sequence[RequestRecord]) -> Figure:
    figure = Figure(figsize=(9, 6), layout="constrained")
    ttft_axes, itl_axes = figure.subplots(2, 1, sharex=True)
    ttft_axes.scatter([r.start_s for r in records], [r.ttft_s * 1000 for r in records], s=10)
    ttft_axes.set(ylabel="TTFT (ms)", title="TTFT by send time, ITL by chunk arrival time")
    chunk_times = [time for r in records for time in r.chunk_times_s()]
    gaps = [gap * 1000 for r in records for gap in r.itl_s]
    itl_axes.scatter(chunk_times, gaps, s=4, alpha=0.5)
    itl_axes.set(xlabel="time since the run started (s)", ylabel="ITL (ms)")
    for axes in (ttft_axes, itl_axes):
        axes.grid(alpha=0.3)
    return figure


def timeline_figure(records: Sequence[RequestRecord]) -> Figure:
    """One row per request: waiting for the first token, then streaming the rest."""
    ordered = sorted(records, key=lambda record: record.start_s)
    figure = Figure(figsize=(9, max(3.0, 0.12 * len(ordered) + 1.5)), layout="constrained")
    axes = figure.add_subplot()
    rows = range(len(ordered))
    axes.barh(
        rows,
        [r.ttft_s for r in ordered],
        left=[r.start_s for r in ordered],
        height=0.8,
        color="tab:orange",
        label="until the first token",
    )
    axes.barh(
        rows,
        [r.latency_s - r.ttft_s for r in ordered],
        left=[r.start_s + r.ttft_s for r in ordered],
        height=0.8,
        color="tab:blue",
        label="streaming",
    )
    axes.set(
        xlabel="time since the run started (s)", ylabel="request (by send time)", title="Per-request timeline"
    )
    axes.set_ylim(len(ordered) - 0.5, -0.5)  # the first request on top, no empty rows
    axes.legend(loc="upper right")  # requests run from top left to bottom right: that corner is free
    return figure


def write_tune_plot(results: Sequence[SettingResult], ttft_objective_ms: float, path: str) -> str:
    """P99 TTFT against the offered rate for every setting `firsttoken tune` tried, and the
    objective; returns the PNG's path."""
    figure = Figure(figsize=(8, 5), layout="constrained")
    axes = figure.add_subplot()
    for result in results:
        measured = [probe for probe in result.probes if math.isfinite(probe.p99_ttft_ms)]
        probes = sorted(measured, key=lambda probe: probe.rate)
        if probes:
            axes.plot(
                [probe.rate for probe in probes], [probe.p99_ttft_ms for probe in probes], marker="o",
                label=result.setting.label,
            )  # fmt: skip
    axes.axhline(ttft_objective_ms, color="black", linestyle="--", label="objective")
    axes.set(xlabel="offered rate (req/s)", ylabel="TTFT P99 (ms)", title="TTFT P99 by rate, per setting")
    axes.set_yscale("log")
    axes.grid(alpha=0.3)
    axes.legend(fontsize="small")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    FigureCanvasAgg(figure).print_png(path)
    return path
