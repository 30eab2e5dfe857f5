"""Clients that go away: a storm of them mid-prefill and mid-decode, after which every request is
aborted and the engine returns to idle with every KV block free; and one that leaves while its
request waits for a step, which no step then runs."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from typing import Any

import pytest

from firsttoken.core.batch import SchedulerOutput
from firsttoken.engine import AsyncEngine
from firsttoken.outputs import RequestDelta
from firsttoken.sampling_params import SamplingParams
from tests.http_client import HTTP
from tests.reliability.conftest import MAX_MODEL_LEN

NUM_PREFILL_LEAVERS = 8
NUM_DECODE_LEAVERS = 8
# About 200 prompt tokens: several prefill chunks of 32, so the first token is steps away.
LONG_PROMPT = "Tell me a long story about the sea. " * 22


def _leave_mid_prefill(base_url: str, delay_s: float) -> None:
    with _send_streamed_request(base_url):
        time.sleep(delay_s)


def _send_streamed_request(base_url: str) -> socket.socket:
    """A connection that has sent a streamed completion of LONG_PROMPT and reads nothing."""
    body = json.dumps({"prompt": LONG_PROMPT, "max_tokens": 40, "stream": True}).encode()
    host, port = base_url.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)))
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    return sock


def _leave_mid_decode(base_url: str, num_chunks: int) -> None:
    body = {"prompt": "Count to a hundred:", "max_tokens": MAX_MODEL_LEN // 2, "stream": True,
            "ignore_eos": True}  # fmt: skip
    with HTTP.stream("POST", base_url + "/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        for _ in range(num_chunks):
            assert next(line for line in lines if line).startswith('data: {"id"')


def test_a_disconnect_storm_leaves_the_engine_idle(server):
    start = server.engine.stats()
    aborted_before = server.metric("firsttoken:request_success_total", finished_reason="abort")
    threads = [
        threading.Thread(target=_leave_mid_prefill, args=(server.base_url, 0.02 * index))
        for index in range(NUM_PREFILL_LEAVERS)
    ] + [
        threading.Thread(target=_leave_mid_decode, args=(server.base_url, 1 + index % 3))
        for index in range(NUM_DECODE_LEAVERS)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
        assert not thread.is_alive()
    server.wait_for_idle_kv(since=start)
    assert server.engine.stats().num_running == 0
    aborted_after = server.metric("firsttoken:request_success_total", finished_reason="abort")
    num_aborted = aborted_after - aborted_before
    # A client gone before its request was read leaves nothing to abort; the rest were running.
    assert NUM_DECODE_LEAVERS + NUM_PREFILL_LEAVERS // 2 <= num_aborted <= len(threads)
    after = HTTP.post(server.base_url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
    assert after.status_code == 200


class _HeldStep:
    """Wraps the engine core's step: the first step waits until `release()`."""

    def __init__(self, engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch) -> None:
        self.step = engine.core.step
        self.entered = threading.Event()
        self.released = threading.Event()
        monkeypatch.setattr(engine.core, "step", self)

    def __call__(self) -> list[RequestDelta]:
        self.entered.set()
        self.released.wait(timeout=60)
        return self.step()


class _ScheduledRequests:
    """Wraps the scheduler's schedule: every request id that a step ran a chunk of."""

    def __init__(self, engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch) -> None:
        self.schedule = engine.core.scheduler.schedule
        self.req_ids: set[str] = set()
        monkeypatch.setattr(engine.core.scheduler, "schedule", self)

    def __call__(self) -> SchedulerOutput:
        output = self.schedule()
        self.req_ids.update(chunk.req_id for chunk in output.chunks)
        return output


class _NamedSubmissions:
    """Wraps the engine's add_request: names the requests `submitted-0`, `submitted-1`, ... and
    says when each is queued for the engine's loop, and when its add_request has ended
    (admitted, refused or cancelled)."""

    def __init__(self, engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch) -> None:
        self.add_request = engine.add_request
        self.num_submitted = 0
        self.queued = threading.Semaphore(0)
        self.ended = threading.Semaphore(0)
        monkeypatch.setattr(engine, "add_request", self)

    async def __call__(self, prompt: Any, sampling_params: SamplingParams, **options: Any) -> Any:
        req_id = f"submitted-{self.num_submitted}"
        self.num_submitted += 1
        admission = asyncio.ensure_future(self.add_request(prompt, sampling_params, req_id=req_id, **options))
        try:
            await asyncio.sleep(0)  # add_request runs up to its wait for admission: it is queued
            self.queued.release()
            return await admission
        finally:
            self.ended.release()


def test_a_client_that_leaves_while_queued_is_aborted_before_any_step_runs_it(server, monkeypatch):
    start = server.engine.stats()
    aborted_before = server.metric("firsttoken:request_success_total", finished_reason="abort")
    held = _HeldStep(server.engine, monkeypatch)
    scheduled = _ScheduledRequests(server.engine, monkeypatch)
    submissions = _NamedSubmissions(server.engine, monkeypatch)
    running = threading.Thread(
        target=HTTP.post,
        args=(server.base_url + "/v1/completions",),
        kwargs={"json": {"prompt": "Hi", "max_tokens": 2}, "timeout": 60},
    )
    running.start()
    try:
        assert held.entered.wait(timeout=30)  # submitted-0 runs in the held step
        assert submissions.queued.acquire(timeout=30)
        assert submissions.ended.acquire(timeout=30)
        # submitted-1 arrives while the step runs, and its client leaves before the step ends.
        with _send_streamed_request(server.base_url):
            assert submissions.queued.acquire(timeout=30)
        # The disconnect is seen while the request waits: its submission ends before the step.
        assert submissions.ended.acquire(timeout=30), "the departed client's request still waits"
    finally:
        held.released.set()
        running.join(timeout=60)
    server.wait_for_idle_kv(since=start)
    assert scheduled.req_ids == {"submitted-0"}
    aborted_after = server.metric("firsttoken:request_success_total", finished_reason="abort")
    assert aborted_after - aborted_before == 1
