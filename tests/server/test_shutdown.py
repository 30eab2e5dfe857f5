"""Shutting down: in-flight requests drain for a bounded time, then end in-band; never cut."""

from __future__ import annotations

import signal
import threading

import httpx
import pytest
import uvicorn
from fastapi import FastAPI

from firsttoken.server.config import ServerConfig
from firsttoken.server.http_server import DrainingServer
from tests.server.conftest import MODEL_NAME, running_server

LONG_STREAM = {"prompt": "Tell me a long story.", "max_tokens": 400, "ignore_eos": True, "stream": True}


def _events_after_signals(model_path, body, shutdown_timeout_s: float, num_signals: int) -> tuple[list, bool]:
    """Start `body` streaming, signal the server `num_signals` times, and read the stream to its end."""
    config = ServerConfig(port=0, served_model_names=(MODEL_NAME,), shutdown_timeout_s=shutdown_timeout_s)
    with running_server(model_path, config) as server:
        with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            events = [next(line for line in lines if line)]
            for _ in range(num_signals):
                server.server.handle_exit(signal.SIGTERM, None)
            events += [line for line in lines if line]
        aborted = server.server
    return events, aborted.aborted_in_flight


def test_a_request_in_flight_finishes_within_the_drain(model_path):
    body = {**LONG_STREAM, "max_tokens": 8}
    events, aborted = _events_after_signals(model_path, body, shutdown_timeout_s=30, num_signals=1)
    assert events[-1] == "data: [DONE]"
    assert '"finish_reason":"length"' in events[-2]
    assert not aborted


@pytest.mark.parametrize("shutdown_timeout_s,num_signals", [(0.5, 1), (30, 2)])
def test_past_the_drain_time_or_at_a_second_signal_streams_end_with_an_error_event(
    model_path, shutdown_timeout_s, num_signals
):
    events, aborted = _events_after_signals(model_path, LONG_STREAM, shutdown_timeout_s, num_signals)
    # Cut short, not drained to its end (counted in events, since seconds depend on the machine).
    assert len(events) < LONG_STREAM["max_tokens"]
    assert events[-1] == "data: [DONE]"
    assert '"code":"engine_unavailable"' in events[-2]
    assert aborted


def _capture_one_signal(sig: int) -> None:
    server = DrainingServer(uvicorn.Config(FastAPI()), abort_in_flight=None, shutdown_timeout_s=1)
    with server.capture_signals():
        server.handle_exit(sig, None)
    assert server.should_exit


def test_ctrl_c_is_raised_again_after_the_shutdown_and_sigterm_is_not():
    assert threading.current_thread() is threading.main_thread()
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            _capture_one_signal(signal.SIGINT)
        _capture_one_signal(signal.SIGTERM)  # nothing raised: run_serve returns the exit status
    finally:
        signal.signal(signal.SIGINT, inherited)
