"""The serving client against a fake server with scripted delays: the timings come back exactly.

The delays move a scripted clock the client reads too, so no result depends on how busy the
machine is; the concurrency cap is shown by counting the requests the server has in flight.
"""

from __future__ import annotations

import asyncio
import itertools
import math

import pytest

from firsttoken.bench.datasets import BenchPrompt
from firsttoken.bench.serve_client import (
    CHAT_COMPLETIONS,
    SYSTEM_CLOCK,
    Clock,
    LoadShape,
    ServeTarget,
    arrival_offsets,
    run_load,
)
from tests.bench.fake_openai_server import MODEL_NAME, Script, serve_in_thread
from tests.bench.scripted_clock import ScriptedClock

# Distinct delays: a chunk stamped in the wrong place gives a different list.
TTFT_S, GAPS_S = 0.300, (0.060, 0.180, 0.020, 0.120)
# One request at a time: the scripted clock is shared by every request in flight.
ONE_AT_A_TIME = LoadShape(max_concurrency=1)


def _scripted_server(ttft_s: float, gaps_s: tuple[float, ...], tokens_per_chunk: int = 1):
    clock = ScriptedClock()
    script = Script(ttft_s=ttft_s, gaps_s=gaps_s, tokens_per_chunk=tokens_per_chunk, clock=clock)
    for server in serve_in_thread(script):
        yield server, clock


@pytest.fixture(scope="module")
def server():
    """Real sleeps: for what does not depend on timing."""
    yield from serve_in_thread(Script(ttft_s=0.020, gaps_s=(0.010, 0.010)))


@pytest.fixture(scope="module")
def scripted_server():
    yield from _scripted_server(TTFT_S, GAPS_S)


@pytest.fixture(scope="module")
def batched_server():
    yield from _scripted_server(0.100, (0.050, 0.050), tokens_per_chunk=2)


@pytest.fixture(scope="module")
def instant_server():
    yield from _scripted_server(0.0, ())


@pytest.fixture(scope="module")
def failing_server():
    yield from serve_in_thread(Script(ttft_s=0.0, gaps_s=(), status_code=503))


def _prompts(count: int, max_tokens: int = 5) -> list[BenchPrompt]:
    return [BenchPrompt(f"prompt {index}", 3, max_tokens) for index in range(count)]


def _run(
    base_url: str,
    prompts: list[BenchPrompt],
    shape: LoadShape | None = None,
    clock: Clock = SYSTEM_CLOCK,
    **target_options,
):
    target = ServeTarget(base_url, **target_options)
    return asyncio.run(run_load(target, shape or LoadShape(), prompts, show_progress=False, clock=clock))


@pytest.mark.parametrize("endpoint", ["/v1/completions", CHAT_COMPLETIONS])
def test_ttft_itl_and_tpot_are_the_scripted_delays(scripted_server, endpoint):
    server, clock = scripted_server
    run = _run(server.base_url, _prompts(3), ONE_AT_A_TIME, clock, endpoint=endpoint)
    assert run.model == MODEL_NAME
    for record in run.records:
        assert record.success, record.error
        assert record.ttft_s == pytest.approx(TTFT_S)
        assert record.itl_s == pytest.approx(list(GAPS_S))
        assert record.num_output_tokens == len(GAPS_S) + 1
        assert record.num_prompt_tokens == 7  # the server's usage wins over the client's estimate
        assert record.tpot_s == pytest.approx(sum(GAPS_S) / len(GAPS_S))
        assert record.latency_s == pytest.approx(record.ttft_s + sum(record.itl_s))
    assert run.duration_s == pytest.approx(3 * (TTFT_S + sum(GAPS_S)))


def test_request_bodies_stream_with_usage(server):
    _run(server.base_url, _prompts(1, max_tokens=9), ignore_eos=True, endpoint=CHAT_COMPLETIONS)
    body = server.state.bodies[-1]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == 9 and body["ignore_eos"] is True and body["model"] == MODEL_NAME
    assert body["messages"] == [{"role": "user", "content": "prompt 0"}]


def test_tpot_counts_the_tokens_usage_reports_not_the_chunks(batched_server):
    server, clock = batched_server
    (record,) = _run(server.base_url, _prompts(1), ONE_AT_A_TIME, clock).records
    assert record.num_output_tokens == 6
    assert record.tpot_s == pytest.approx((0.050 + 0.050) / 5)


def test_max_concurrency_caps_requests_in_flight(server):
    server.state.max_in_flight = 0
    run = _run(server.base_url, _prompts(6), LoadShape(max_concurrency=2))
    assert all(record.success for record in run.records)
    # All six leave at once: the cap, not the arrivals, holds the last four back.
    assert server.state.max_in_flight == 2


def test_requests_leave_at_their_poisson_arrival_times(instant_server):
    server, clock = instant_server
    shape = LoadShape(request_rate=10.0, seed=3)
    run = _run(server.base_url, _prompts(5), shape, clock)
    offsets = arrival_offsets(5, shape.request_rate, shape.seed)
    assert [record.start_s for record in run.records] == pytest.approx(offsets)


def test_arrival_offsets_are_a_seeded_poisson_process():
    offsets = arrival_offsets(4000, 8.0, seed=1)
    gaps = [later - earlier for earlier, later in itertools.pairwise(offsets)]
    assert offsets[0] == 0.0 and min(gaps) >= 0
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 8.0, rel=0.05)
    # Exponential gaps: the standard deviation equals the mean.
    mean = sum(gaps) / len(gaps)
    assert math.sqrt(sum((gap - mean) ** 2 for gap in gaps) / len(gaps)) == pytest.approx(mean, rel=0.08)
    assert arrival_offsets(4000, 8.0, seed=1) == offsets
    assert arrival_offsets(3, math.inf, seed=1) == [0.0, 0.0, 0.0]


def test_http_errors_are_recorded_not_raised(failing_server):
    (record,) = _run(failing_server.base_url, _prompts(1)).records
    assert not record.success
    assert record.error.startswith("HTTP 503")


def test_unreachable_server_is_a_failed_request():
    (record,) = _run("http://127.0.0.1:9", _prompts(1), model="m").records
    assert not record.success and "ConnectError" in record.error
