"""The bench's reading of the server's counters from Prometheus text."""

from __future__ import annotations

from prometheus_client import generate_latest

from firsttoken.bench.server_counters import ServerCounters, format_counters, parse_counters
from firsttoken.metrics.prometheus import PrometheusMetrics
from tests.metrics.test_prometheus import STATS


def test_reads_our_counters_and_their_rates_over_a_run():
    metrics = PrometheusMetrics("m", lambda: STATS)
    counters = parse_counters(generate_latest(metrics.registry).decode())
    assert counters == ServerCounters(400, 96, 40, 13)
    run = counters.minus(ServerCounters(100, 0, 20, 3))
    assert run.prefix_cache_hit_rate == 96 / 300 and run.spec_acceptance_rate == 10 / 20
    assert format_counters(run) == (
        "server counters over the run: prefix cache hit rate 32.0% of 300 prompt tokens; "
        "speculative acceptance 50.0% of 20 proposed tokens"
    )


def test_another_servers_metrics_give_none():
    assert parse_counters("# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0.0\n") is None
