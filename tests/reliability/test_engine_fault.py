"""An engine step that fails mid-decode: every request in flight ends at once, in-band (an error
event and [DONE], or a 503), /health turns unhealthy, and nothing hangs."""

from __future__ import annotations

import threading

import pytest

from tests.http_client import HTTP
from tests.reliability.conftest import SHARED_ENGINE_OPTIONS, shared_config
from tests.server.conftest import running_server

NUM_STREAMS = 4
STEPS_BEFORE_FAULT = 12
# How long a request may take to end after the fault: it tells a hang from a busy machine, and
# measures nothing (under two busy cores, 30 s was too short for the last stream to drain).
HANG_LIMIT_S = 120


@pytest.fixture
def server_to_break(two_layer_model_path):
    """A server of its own: its engine stays dead after the test."""
    with running_server(two_layer_model_path, shared_config(), **SHARED_ENGINE_OPTIONS) as running:
        yield running


def test_an_engine_fault_ends_every_request_in_band(server_to_break, monkeypatch):
    core = server_to_break.engine.core
    step = core.step
    num_steps = 0
    streams_started = threading.Barrier(NUM_STREAMS + 1, timeout=60)

    def step_that_fails_later():
        nonlocal num_steps
        num_steps += 1
        if num_steps > STEPS_BEFORE_FAULT:
            raise RuntimeError("simulated device failure")
        return step()

    outcomes: dict[str, object] = {}

    def stream(index: int) -> None:
        body = {"prompt": f"Story {index}:", "max_tokens": 100, "ignore_eos": True, "stream": True}
        url = server_to_break.base_url + "/v1/completions"
        with HTTP.stream("POST", url, json=body, timeout=60) as response:
            streams_started.wait()
            outcomes[f"stream {index}"] = [line for line in response.iter_lines() if line]

    def whole() -> None:
        body = {"prompt": "Story:", "max_tokens": 100, "ignore_eos": True}
        outcomes["whole"] = HTTP.post(server_to_break.base_url + "/v1/completions", json=body, timeout=60)

    threads = [threading.Thread(target=stream, args=(index,)) for index in range(NUM_STREAMS)]
    threads.append(threading.Thread(target=whole))
    for thread in threads:
        thread.start()
    streams_started.wait()
    monkeypatch.setattr(core, "step", step_that_fails_later)
    for thread in threads:
        thread.join(timeout=HANG_LIMIT_S)
        assert not thread.is_alive(), "a request hung after the engine failed"
    for index in range(NUM_STREAMS):
        events = outcomes[f"stream {index}"]
        assert events[-1] == "data: [DONE]"
        assert '"code":"engine_unavailable"' in events[-2], events[-2]
    assert outcomes["whole"].status_code == 503
    assert outcomes["whole"].json()["error"]["code"] == "engine_unavailable"
    health = HTTP.get(server_to_break.base_url + "/health")
    assert health.status_code == 503 and health.json()["error"]["type"] == "server_error"
    refused = HTTP.post(server_to_break.base_url + "/v1/completions", json={"prompt": "Hi"}, timeout=10)
    assert refused.status_code == 503
