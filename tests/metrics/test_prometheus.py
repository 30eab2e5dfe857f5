"""Prometheus metrics: observations computed from timestamps, exposition, and the dashboard."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re

import pytest
from prometheus_client.parser import text_string_to_metric_families

from firsttoken.outputs import EngineStats
from firsttoken.metrics.prometheus import PrometheusMetrics
from firsttoken.outputs import RequestMetrics
from firsttoken.metrics.ttft_stages import TTFTStages
from firsttoken.outputs import RequestDelta

DASHBOARD = pathlib.Path(__file__).parents[2] / "deployment" / "grafana" / "firsttoken.json"
STATS = EngineStats(
    num_running=3,
    num_waiting=2,
    kv_cache_usage=0.25,
    num_kv_blocks=100,
    num_free_kv_blocks=75,
    prefix_cache_queries=400,
    prefix_cache_hits=96,
    num_preemptions=1,
    num_prefill_tokens=400,
    num_decode_tokens=50,
    num_steps=60,
    last_prefill_budget=256,
    num_pinned_tokens=0,
    spec_decode_num_drafts=10,
    spec_decode_num_draft_tokens=40,
    spec_decode_num_accepted_tokens=13,
    spec_decode_accepted_per_position=(7, 4, 2, 0),
)


def metrics_at(
    first_token: float | None, last_token: float | None, finished: float | None, generated: int
) -> RequestMetrics:
    return RequestMetrics(
        arrival_time=10.0,
        tokenized_time=10.01,
        first_scheduled_time=10.03,
        first_token_time=first_token,
        last_token_time=last_token,
        finished_time=finished,
        num_prompt_tokens=7,
        num_generation_tokens=generated,
        num_cached_tokens=0,
        num_prefill_chunks=1,
        num_preemptions=0,
    )


def delta(token_ids: list[int], metrics: RequestMetrics, finish_reason: str | None = None) -> RequestDelta:
    return RequestDelta(
        req_id="r",
        token_ids=token_ids,
        text="x" * len(token_ids),
        logprobs=None,
        finished=finish_reason is not None,
        finish_reason=finish_reason,
        stop_reason=None,
        num_prompt_tokens=7,
        num_cached_tokens=0,
        metrics=metrics,
    )


def samples(metrics: PrometheusMetrics) -> dict[tuple[str, tuple], float]:
    text = metrics.render().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(metrics: PrometheusMetrics, name: str, **labels: str) -> float:
    return samples(metrics)[(name, tuple(sorted({"model_name": "m", **labels}.items())))]


def test_request_observations_come_from_timestamps():
    metrics = PrometheusMetrics("m", lambda: STATS)
    metrics.on_delta(
        delta([5], metrics_at(10.2, 10.2, None, 1)), received_time=10.25, previous_token_time=None
    )
    metrics.on_delta(
        delta([6], metrics_at(10.2, 10.3, None, 2)), received_time=10.35, previous_token_time=10.25
    )
    metrics.on_delta(
        delta([7], metrics_at(10.2, 10.4, 10.4, 3), "length"), received_time=10.5, previous_token_time=10.35
    )
    assert value(metrics, "firsttoken:time_to_first_token_seconds_sum") == pytest.approx(0.25)
    assert value(metrics, "firsttoken:time_to_first_token_seconds_count") == 1
    assert value(metrics, "firsttoken:time_to_first_token_seconds_bucket", le="0.1") == 0
    assert value(metrics, "firsttoken:time_to_first_token_seconds_bucket", le="0.5") == 1
    assert value(metrics, "firsttoken:inter_token_latency_seconds_count") == 2
    assert value(metrics, "firsttoken:inter_token_latency_seconds_sum") == pytest.approx(0.25)
    assert value(metrics, "firsttoken:e2e_request_latency_seconds_sum") == pytest.approx(0.5)
    assert value(metrics, "firsttoken:request_queue_time_seconds_sum") == pytest.approx(0.02)
    assert value(metrics, "firsttoken:request_prefill_time_seconds_sum") == pytest.approx(0.17)
    assert value(metrics, "firsttoken:prompt_tokens_total") == 7
    assert value(metrics, "firsttoken:generation_tokens_total") == 3
    assert value(metrics, "firsttoken:request_success_total", finished_reason="length") == 1
    assert value(metrics, "firsttoken:request_success_total", finished_reason="abort") == 0


def test_abort_before_the_first_token_counts_no_ttft():
    metrics = PrometheusMetrics("m", lambda: STATS)
    metrics.on_delta(
        delta([], metrics_at(None, None, 10.1, 0), "abort"), received_time=10.1, previous_token_time=None
    )
    assert value(metrics, "firsttoken:time_to_first_token_seconds_count") == 0
    assert value(metrics, "firsttoken:request_prefill_time_seconds_count") == 0
    assert value(metrics, "firsttoken:request_queue_time_seconds_count") == 1
    assert value(metrics, "firsttoken:request_success_total", finished_reason="abort") == 1


def test_requests_with_a_ttft_objective_count_as_met_or_missed_with_the_prediction_error():
    metrics = PrometheusMetrics("m", lambda: STATS)
    for ttft_slo_s, predicted_s in ((0.5, 0.2), (0.2, 0.15), (None, None)):
        timed = dataclasses.replace(
            metrics_at(10.2, 10.2, None, 1), ttft_slo_s=ttft_slo_s, predicted_ttft_s=predicted_s
        )
        metrics.on_delta(delta([5], timed), received_time=10.25, previous_token_time=None)
    assert value(metrics, "firsttoken:ttft_slo_requests_total", outcome="met") == 1
    assert value(metrics, "firsttoken:ttft_slo_requests_total", outcome="missed") == 1
    assert value(metrics, "firsttoken:ttft_prediction_error_seconds_count") == 2
    assert value(metrics, "firsttoken:ttft_predicted_seconds_sum") == pytest.approx(0.35)
    assert value(metrics, "firsttoken:ttft_prediction_error_seconds_sum") == pytest.approx(0.05 + 0.10)
    refusing = EngineStats(**{**STATS.__dict__, "num_slo_refusals": 4, "num_deferred_decodes": 9})
    scraped = PrometheusMetrics("m", lambda: refusing)
    assert value(scraped, "firsttoken:num_ttft_slo_refusals_total") == 4
    assert value(scraped, "firsttoken:num_deferred_decodes_total") == 9


def test_engine_stats_are_read_at_scrape_time():
    current = [STATS]
    metrics = PrometheusMetrics("m", lambda: current[0])
    assert value(metrics, "firsttoken:kv_cache_usage_perc") == 0.25
    assert value(metrics, "firsttoken:num_requests_running") == 3
    assert value(metrics, "firsttoken:num_requests_waiting") == 2
    assert value(metrics, "firsttoken:prefix_cache_queries_total") == 400
    assert value(metrics, "firsttoken:prefix_cache_hits_total") == 96
    assert value(metrics, "firsttoken:num_preemptions_total") == 1
    current[0] = EngineStats(**{**STATS.__dict__, "kv_cache_usage": 0.0, "num_running": 0})
    assert value(metrics, "firsttoken:kv_cache_usage_perc") == 0.0
    assert value(metrics, "firsttoken:num_requests_running") == 0


def test_replica_stats_give_one_series_per_replica():
    busy = EngineStats(**{**STATS.__dict__, "num_running": 5, "spec_decode_accepted_per_position": (1,)})
    metrics = PrometheusMetrics("m", lambda: STATS, replica_stats=lambda: {"r1": STATS, "r2": busy})
    assert value(metrics, "firsttoken:num_requests_running", replica="r1") == 3
    assert value(metrics, "firsttoken:num_requests_running", replica="r2") == 5
    assert value(metrics, "firsttoken:prefix_cache_hits_total", replica="r2") == 96
    assert (
        value(metrics, "firsttoken:spec_decode_num_accepted_tokens_per_pos_total", replica="r2", position="0")
        == 1
    )
    families = {family.name: family for family in text_string_to_metric_families(metrics.render().decode())}
    running = families["firsttoken:num_requests_running"].samples
    assert sorted(sample.labels["replica"] for sample in running) == ["r1", "r2"], "one family, two series"


def test_two_servers_do_not_share_metrics():
    first, second = PrometheusMetrics("m", lambda: STATS), PrometheusMetrics("m", lambda: STATS)
    first.on_delta(delta([1], metrics_at(10.2, 10.2, None, 1)), received_time=10.3, previous_token_time=None)
    assert value(first, "firsttoken:time_to_first_token_seconds_count") == 1
    assert value(second, "firsttoken:time_to_first_token_seconds_count") == 0


def test_ttft_stages_sum_to_ttft():
    stages = TTFTStages.from_metrics(metrics_at(10.2, 10.2, None, 1), first_token_received_time=10.21)
    assert stages.tokenize_s == pytest.approx(0.01)
    assert stages.queue_s == pytest.approx(0.02)
    assert stages.prefill_s == pytest.approx(0.17)
    assert stages.first_token_handoff_s == pytest.approx(0.01)
    assert stages.ttft_s == pytest.approx(0.21)
    assert sum(v for k, v in stages.durations().items() if k != "ttft") == pytest.approx(stages.ttft_s)
    waiting = TTFTStages.from_metrics(metrics_at(None, None, None, 0), first_token_received_time=None)
    assert waiting.ttft_s is None and waiting.first_token_handoff_s is None and waiting.prefill_s is None


def test_dashboard_queries_only_exported_metrics_and_shows_them_all():
    metrics = PrometheusMetrics("m", lambda: STATS)
    metrics.on_delta(
        delta([1], metrics_at(10.2, 10.2, 10.2, 1), "stop"), received_time=10.3, previous_token_time=None
    )
    exported = {name for name, _ in samples(metrics)}
    dashboard = json.loads(DASHBOARD.read_text())
    expressions = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", ())]
    queried = {name for expr in expressions for name in re.findall(r"firsttoken:[a-z0-9_]+", expr)}
    assert queried <= exported, queried - exported
    families = {
        re.sub(r"_(bucket|sum|count|total)$", "", name) for name in exported if not name.endswith("_created")
    }
    shown = {re.sub(r"_(bucket|sum|count|total)$", "", name) for name in queried}
    assert families <= shown, families - shown
