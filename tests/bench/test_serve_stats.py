"""Serving metric math on hand-made records: every number is known in advance."""

from __future__ import annotations

import pytest

from firsttoken.bench.serve_overhead import (
    OfflineBaseline,
    format_overhead,
    mean_concurrency,
    measure_offline_baseline,
    overhead_rows,
)
from firsttoken.bench.serve_stats import SLO, RequestRecord, summarize_run
from firsttoken.bench.stats import summarize
from firsttoken.errors import InvalidInputError


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
    assert summary.slo_attainment == pytest.approx(2 / 4)  # of the successful requests
    assert summary.num_completed == 4 and summary.num_failed == 1
    assert summary.request_throughput == pytest.approx(4 / 2.0)
    assert summary.total_output_tokens == 8 and summary.total_input_tokens == 40
    assert summary.output_token_throughput == pytest.approx(4.0)
    assert summary.total_token_throughput == pytest.approx(24.0)
    assert SLO(e2e_ms=250).is_met_by(records[0]) is True  # 200 ms end to end
    assert SLO(e2e_ms=250).is_met_by(records[1]) is False  # 350 ms end to end
    assert SLO().is_met_by(records[4]) is False  # a failed request never counts


def test_goodput_objectives_parse_as_vllms_client_takes_them():
    assert SLO.from_goodput_args(["ttft:500"]) == SLO(ttft_ms=500)
    assert SLO.from_goodput_args(["ttft:500", "tpot:50", "e2el:3000"]) == SLO(500, 50, 3000)
    with pytest.raises(InvalidInputError, match="goodput: 'itl:5': the objective is one of"):
        SLO.from_goodput_args(["itl:5"])
    for bad in ("ttft", "ttft:", "ttft:fast", "ttft:0", "ttft:-3"):
        with pytest.raises(InvalidInputError, match="give the objective as NAME:MS"):
            SLO.from_goodput_args([bad])
    nothing_succeeded = summarize_run([RequestRecord(0.0, 10, error="HTTP 429")], 1.0, SLO(ttft_ms=1))
    assert nothing_succeeded.slo_attainment is None


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


def test_mean_concurrency_is_time_in_flight_over_the_run():
    records = [
        _record(0.5, [0.5], 2),
        _record(1.0, [1.0], 2),
        RequestRecord(start_s=0.0, num_prompt_tokens=10),
    ]
    assert mean_concurrency(records, duration_s=2.0) == pytest.approx(1.5)  # 1 s + 2 s of 2 s
    assert mean_concurrency(records, duration_s=0.0) == 0.0


def test_overhead_divides_served_figures_by_the_offline_ones():
    records = [_record(0.1, [0.02, 0.04], 3), _record(0.3, [0.06], 2)]
    summary = summarize_run(records, duration_s=1.0, slo=SLO())
    baseline = OfflineBaseline(input_len=16, decode_batch_size=2, ttft_ms=50.0, tpot_ms=15.0)
    rows = {row[0]: row[1:] for row in overhead_rows(summary, baseline)}
    assert rows["TTFT P50"] == pytest.approx([200.0, 50.0, 4.0])
    assert rows["TTFT P99"][2] == pytest.approx(summary.ttft_ms.p99 / 50.0)
    assert rows["TPOT mean"] == pytest.approx([45.0, 15.0, 3.0])
    assert "a batch of 2" in format_overhead(summary, baseline)


def test_offline_baseline_times_the_engine_on_the_runs_shape(llm):
    baseline = measure_offline_baseline(llm, input_len=16, decode_batch_size=2, runs=2)
    assert baseline.input_len == 16 and baseline.decode_batch_size == 2
    assert baseline.ttft_ms > 0 and baseline.tpot_ms > 0


def test_offered_rate_is_what_was_sent_not_the_nominal_rate():
    records = [_record(0.1, [0.01], 2, start=start) for start in (0.0, 0.5, 1.0, 2.0)]
    summary = summarize_run(records, duration_s=3.0, slo=SLO())
    assert summary.offered_rate == pytest.approx(3 / 2.0)
    assert summarize_run(records[:1], duration_s=1.0, slo=SLO()).offered_rate is None
