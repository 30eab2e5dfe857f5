"""Summaries of a sample of durations: mean, median, tail percentiles, extremes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np


@dataclass(frozen=True)
class Distribution:
    """Summary statistics of one sample, in the sample's unit (percentiles interpolate linearly,
    as numpy and `vllm bench serve` do)."""

    count: int
    mean: float
    std: float
    median: float
    p90: float
    p99: float
    min: float
    max: float

    def scaled(self, factor: float) -> Distribution:
        """The same summary in another unit (seconds -> ms is factor 1000)."""
        return Distribution(
            self.count,
            *(
                value * factor
                for value in (self.mean, self.std, self.median, self.p90, self.p99, self.min, self.max)
            ),
        )

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def summarize(values: Sequence[float]) -> Distribution:
    """The summary of `values`; an empty sample summarizes to zeros (a run where nothing finished)."""
    if not values:
        return Distribution(0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    sample = np.asarray(values, dtype=np.float64)
    p50, p90, p99 = np.percentile(sample, [50, 90, 99])
    return Distribution(
        count=len(sample),
        mean=float(sample.mean()),
        std=float(sample.std()),
        median=float(p50),
        p90=float(p90),
        p99=float(p99),
        min=float(sample.min()),
        max=float(sample.max()),
    )
