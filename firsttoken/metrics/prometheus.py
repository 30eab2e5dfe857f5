"""Prometheus metrics with vLLM's names and meanings under the `firsttoken:` prefix.

Per-request histograms and counters are observed from request deltas as they reach the
front end; the engine's gauges and lifetime counters are read from its latest stats snapshot
at scrape time. Everything lives in one CollectorRegistry per server, never the global one.
"""

from __future__ import annotations

from typing import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from firsttoken.outputs import EngineStats, RequestDelta, RequestMetrics

PREFIX = "firsttoken:"
FINISH_REASONS = ("stop", "length", "abort")

# From 1 ms (a prefix-cache hit on a GPU) to 60 s (a long prompt behind a long queue).
TTFT_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    60.0,
)
ITL_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
REQUEST_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
)


class PrometheusMetrics:
    """Owns a server's CollectorRegistry: request histograms and counters it observes from
    deltas, and a collector that reads the engine's stats snapshot when scraped.

    With `replica_stats` (engine replicas behind a router: each replica's latest snapshot by
    its name), the engine's gauges and counters are one series per replica, labelled `replica`,
    and `engine_stats` is not read.
    """

    def __init__(
        self,
        model_name: str,
        engine_stats: Callable[[], EngineStats],
        replica_stats: Callable[[], Mapping[str, EngineStats]] | None = None,
    ) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]

        def histogram(name: str, documentation: str, buckets: tuple[float, ...]) -> Histogram:
            metric = Histogram(PREFIX + name, documentation, labels, registry=self.registry, buckets=buckets)
            return metric.labels(model_name)

        def counter(name: str, documentation: str) -> Counter:
            return Counter(PREFIX + name, documentation, labels, registry=self.registry).labels(model_name)

        self.time_to_first_token = histogram(
            "time_to_first_token_seconds",
            "Histogram of time to first token in seconds, from arrival (tokenization included).",
            TTFT_BUCKETS,
        )
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS
        )
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds",
            "Histogram of end-to-end request latency in seconds.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.request_queue_time = histogram(
            "request_queue_time_seconds",
            "Histogram of time spent waiting to be scheduled in seconds.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.request_prefill_time = histogram(
            "request_prefill_time_seconds",
            "Histogram of time from first scheduled to first token in seconds.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.ttft_predicted = histogram(
            "ttft_predicted_seconds",
            "Histogram of the TTFT the scheduler predicted on arrival, in seconds, for requests with "
            "a TTFT objective (to set beside time_to_first_token_seconds).",
            TTFT_BUCKETS,
        )
        self.ttft_prediction_error = histogram(
            "ttft_prediction_error_seconds",
            "Histogram of |measured - predicted| TTFT in seconds, for requests with a TTFT objective "
            "(the scheduler predicts each one's TTFT on arrival).",
            REQUEST_LATENCY_BUCKETS,
        )
        self._ttft_slo_requests = Counter(
            PREFIX + "ttft_slo_requests",
            "Requests with a TTFT objective that reached their first token, by whether it came "
            "within the objective (rate of met: goodput).",
            ["model_name", "outcome"],
            registry=self.registry,
        )
        for outcome in ("met", "missed"):
            self._ttft_slo_requests.labels(model_name, outcome)
        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Number of generation tokens processed.")
        self._request_success = Counter(
            PREFIX + "request_success",
            "Count of successfully processed requests.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        for reason in FINISH_REASONS:  # every series exists from the start, at 0
            self._request_success.labels(model_name, reason)
        self._model_name = model_name
        self.registry.register(_EngineStatsCollector(model_name, engine_stats, replica_stats))

    def on_delta(self, delta: RequestDelta, received_time: float, previous_token_time: float | None) -> None:
        """Observe one delta as it reaches the front end (AsyncEngine's RequestObserver)."""
        metrics = delta.metrics
        if delta.token_ids:
            if previous_token_time is None:
                self.time_to_first_token.observe(received_time - metrics.arrival_time)
                self._observe_ttft_objective(metrics, received_time - metrics.arrival_time)
                self.prompt_tokens.inc(delta.num_prompt_tokens)
            else:
                self.inter_token_latency.observe(received_time - previous_token_time)
            self.generation_tokens.inc(len(delta.token_ids))
        if not delta.finished:
            return
        self.e2e_request_latency.observe(received_time - metrics.arrival_time)
        if metrics.queue_s is not None:
            self.request_queue_time.observe(metrics.queue_s)
        if metrics.prefill_s is not None:
            self.request_prefill_time.observe(metrics.prefill_s)
        self._request_success.labels(self._model_name, delta.finish_reason).inc()

    def _observe_ttft_objective(self, metrics: RequestMetrics, ttft_s: float) -> None:
        if metrics.ttft_slo_s is None:
            return
        outcome = "met" if ttft_s <= metrics.ttft_slo_s else "missed"
        self._ttft_slo_requests.labels(self._model_name, outcome).inc()
        if metrics.predicted_ttft_s is not None:
            self.ttft_predicted.observe(metrics.predicted_ttft_s)
            self.ttft_prediction_error.observe(abs(ttft_s - metrics.predicted_ttft_s))

    def render(self) -> bytes:
        """The exposition text of every metric (Prometheus' text format)."""
        return generate_latest(self.registry)


class _EngineStatsCollector:
    """Reads the engine's gauges and lifetime counters from its stats snapshot at scrape time
    (each replica's, when given)."""

    def __init__(
        self,
        model_name: str,
        engine_stats: Callable[[], EngineStats],
        replica_stats: Callable[[], Mapping[str, EngineStats]] | None,
    ) -> None:
        self._model_name = model_name
        self._engine_stats = engine_stats
        self._replica_stats = replica_stats

    def _labelled_snapshots(self) -> tuple[list[str], list[tuple[list[str], EngineStats]]]:
        """The label names, and each snapshot with its label values."""
        if self._replica_stats is None:
            return ["model_name"], [([self._model_name], self._engine_stats())]
        snapshots = sorted(self._replica_stats().items())
        return ["model_name", "replica"], [([self._model_name, name], stats) for name, stats in snapshots]

    def collect(self) -> Iterator[Metric]:
        label_names, snapshots = self._labelled_snapshots()
        families: dict[str, Metric] = {}
        for label_values, stats in snapshots:
            for family_type, name, documentation, value in _engine_series(stats):
                if name not in families:
                    families[name] = family_type(PREFIX + name, documentation, labels=label_names)
                families[name].add_metric(label_values, value)
        yield from families.values()
        per_position = CounterMetricFamily(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            labels=[*label_names, "position"],
        )
        for label_values, stats in snapshots:
            for position, count in enumerate(stats.spec_decode_accepted_per_position):
                per_position.add_metric([*label_values, str(position)], count)
        yield per_position


def _engine_series(stats: EngineStats) -> Iterator[tuple[type, str, str, float]]:
    """(family type, name, documentation, value) of every engine gauge and counter."""
    gauges = (
        ("num_requests_running", "Number of requests in model execution batches.", stats.num_running),
        ("num_requests_waiting", "Number of requests waiting to be processed.", stats.num_waiting),
        ("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", stats.kv_cache_usage),
        (
            "prefill_token_budget",
            "Prefill tokens the last engine step allowed (the adaptive chunk size).",
            stats.last_prefill_budget,
        ),
        (
            "num_pinned_tokens",
            "Prompt tokens whose KV is pinned in the prefix cache.",
            stats.num_pinned_tokens,
        ),
    )
    counters = (
        (
            "prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            stats.prefix_cache_queries,
        ),
        (
            "prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            stats.prefix_cache_hits,
        ),
        ("num_preemptions", "Cumulative number of preemptions from the engine.", stats.num_preemptions),
        (
            "num_ttft_slo_refusals",
            "Requests refused on arrival as predicted to miss their TTFT objective.",
            stats.num_slo_refusals,
        ),
        (
            "num_deferred_decodes",
            "Decodes that sat out a step so that a prefill could meet its TTFT objective.",
            stats.num_deferred_decodes,
        ),
        ("spec_decode_num_drafts", "Number of spec decoding drafts.", stats.spec_decode_num_drafts),
        (
            "spec_decode_num_draft_tokens",
            "Number of draft tokens.",
            stats.spec_decode_num_draft_tokens,
        ),
        (
            "spec_decode_num_accepted_tokens",
            "Number of accepted tokens.",
            stats.spec_decode_num_accepted_tokens,
        ),
    )
    for family_type, entries in ((GaugeMetricFamily, gauges), (CounterMetricFamily, counters)):
        for name, documentation, value in entries:
            yield family_type, name, documentation, value
