"""The serving plots are written as real, non-empty PNG files."""

from __future__ import annotations

import random

from firsttoken.bench.plots import write_plots
from firsttoken.bench.serve_stats import RequestRecord

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _records(count: int) -> list[RequestRecord]:
    rng = random.Random(0)
    records = []
    for index in range(count):
        itl = [rng.uniform(0.01, 0.05) for _ in range(rng.randint(1, 20))]
        ttft = rng.uniform(0.05, 0.5)
        records.append(RequestRecord(index * 0.1, 100, True, ttft, itl, ttft + sum(itl), len(itl) + 1))
    records.append(RequestRecord(0.3, 100, error="HTTP 500"))  # failures are left out, not plotted as zeros
    return records


def test_three_png_plots_are_written(tmp_path):
    paths = write_plots(_records(40), str(tmp_path / "run"))
    assert sorted(p.rsplit("/", 1)[-1] for p in paths) == [
        "run_latency_over_time.png",
        "run_timeline.png",
        "run_ttft_cdf.png",
    ]
    for path in paths:
        with open(path, "rb") as handle:
            data = handle.read()
        assert data.startswith(PNG_SIGNATURE)
        assert len(data) > 10_000  # axes, ticks, and the data drawn on them
