"""Serving metric math on hand-made records: every number is known in advance."""

from __future__ import annotations

import pytest

from firsttoken.bench.serve_stats import SLO, RequestRecord, summarize_run
from firsttoken.bench.stats import summarize


def _record(ttft: float, itl: list[float], num_output_tokens: int, start: float = 0.0) -> RequestRecord:
    return RequestRecord(
        start_s=start,
        num_prompt_tokens=10,
        success=True,
        ttft_s=ttft,
        itl_s=itl,
        latency_s=ttft + sum(itl),
        num_output_tokens=num_output_tokens,
    )


def test_tpot_is_decode_time_over_tokens_after_the_first():
    assert _record(0.2, [0.1, 0.3], 3).tpot_s == pytest.approx(0.2)
    assert _record(0.2, [0.1, 0.3], 5).tpot_s == pytest.approx(0.1)  # a chunk may carry several tokens
    assert _record(0.2, [], 1).tpot_s is None


def test_chunk_times_accumulate_the_gaps_from_the_first_token():
    assert _record(0.5, [0.1, 0.2], 3, start=1.0).chunk_times_s() == pytest.approx([1.6, 1.8])


def test_goodput_counts_requests_meeting_every_slo():
    records = [
        _record(0.1, [0.05, 0.05], 3),  # meets both
        _record(0.3, [0.05], 2),  # TTFT too slow
        _record(0.1, [0.2], 2),  # TPOT too slow
        _record(0.1, [], 1),  # no decode: only TTFT applies
        RequestRecord(start_s=0.0, num_prompt_tokens=10, error="HTTP 500"),
    ]
    summary = summarize_run(records, duration_s=2.0, slo=SLO(ttft_ms=200, tpot_ms=100))
    assert summary.goodput == pytest.approx(2 / 2.0)
    assert summary.num_completed == 4 and summary.num_failed == 1
    assert summary.request_throughput == pytest.approx(4 / 2.0)
    assert summary.total_output_tokens == 8 and summary.total_input_tokens == 40
    assert summary.output_token_throughput == pytest.approx(4.0)
    assert summary.total_token_throughput == pytest.approx(24.0)
    assert SLO(e2e_ms=250).is_met_by(records[0]) is True  # 200 ms end to end
    assert SLO(e2e_ms=250).is_met_by(records[1]) is False  # 350 ms end to end
    assert SLO().is_met_by(records[4]) is False  # a failed request never counts


def test_latency_distributions_are_in_ms_over_successful_requests():
    records = [_record(0.1, [0.02, 0.04], 3), _record(0.3, [0.06], 2)]
    summary = summarize_run(records, duration_s=1.0, slo=SLO())
    assert summary.ttft_ms.mean == pytest.approx(200.0)
    assert summary.ttft_ms.median == pytest.approx(200.0)
    assert summary.itl_ms.mean == pytest.approx(40.0)
    assert summary.tpot_ms.median == pytest.approx(45.0)  # 30 ms and 60 ms
    assert summary.e2e_ms.max == pytest.approx(360.0)


def test_percentiles_interpolate_like_numpy():
    dist = summarize([float(value) for value in range(1, 101)])
    assert (dist.median, dist.p90, dist.p99) == pytest.approx((50.5, 90.1, 99.01))
    assert (dist.min, dist.max, dist.count) == (1.0, 100.0, 100)
    assert summarize([]).count == 0
