"""A real server on 127.0.0.1, in a thread of the test process, shared by a test module."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterator

import uvicorn
from prometheus_client.samples import Sample

from firsttoken.engine import AsyncEngine
from firsttoken.outputs import EngineStats
from firsttoken.server.app import create_app
from firsttoken.server.server_config import ServerConfig
from firsttoken.server.http_server import build_server
from tests.conftest import FIXED_THREADS
from tests.http_client import HTTP

SERVER_ENGINE_OPTIONS: dict[str, Any] = dict(
    dtype="float32", kv_cache_memory_bytes=256 << 20, chunk_size=256, max_model_len=2048, **FIXED_THREADS
)
MODEL_NAME = "smollm2"


@dataclass
class RunningServer:
    """A started server: where to reach it, and its engine and uvicorn objects for inspection."""

    base_url: str
    engine: AsyncEngine
    server: uvicorn.Server

    def metric(self, name: str, **labels: str) -> float:
        """One sample's value from /metrics, parsed with prometheus_client's own parser."""
        return _sample_value(self.metric_samples(), name, **labels)

    def metric_samples(self) -> list[Sample]:
        """Every sample /metrics shows now."""
        from prometheus_client.parser import text_string_to_metric_families

        text = HTTP.get(self.base_url + "/metrics").text
        return [sample for family in text_string_to_metric_families(text) for sample in family.samples]

    def wait_for_idle_kv(self, timeout_s: float = 30.0, *, since: EngineStats | None = None) -> EngineStats:
        """Wait until /metrics shows no KV block in use and no request, and the engine has every
        one of its KV blocks free; returns the engine's stats then. The timeout only bounds a
        hang: it is no measure of speed, so it is generous for a busy machine.

        `since`, the engine's stats taken at the test's start, makes a test that ran requests
        prove their end: only a snapshot from after a later engine step counts, never the idle
        state the test started from.
        """
        start = time.monotonic()
        while True:
            stats = self.engine.stats()
            samples = self.metric_samples()
            usage = _sample_value(samples, "firsttoken:kv_cache_usage_perc")
            running = _sample_value(samples, "firsttoken:num_requests_running")
            waiting = _sample_value(samples, "firsttoken:num_requests_waiting")
            elapsed = time.monotonic() - start
            has_stepped = since is None or stats.num_steps > since.num_steps
            all_blocks_free = stats.num_free_kv_blocks == stats.num_kv_blocks
            if usage == 0 and running == 0 and waiting == 0 and all_blocks_free and has_stepped:
                return stats
            if elapsed > timeout_s:
                raise AssertionError(
                    f"KV usage {usage}, {running} running, {waiting} waiting, "
                    f"{stats.num_free_kv_blocks} of {stats.num_kv_blocks} blocks free, "
                    f"{'a' if has_stepped else 'no'} step since the test's start, after {elapsed:.2f}s"
                )
            time.sleep(0.02)


def _sample_value(samples: list[Sample], name: str, **labels: str) -> float:
    for sample in samples:
        if sample.name == name and all(sample.labels.get(key) == value for key, value in labels.items()):
            return sample.value
    raise KeyError(name)


@contextlib.contextmanager
def running_server(model_path: str, config: ServerConfig, **engine_options: Any) -> Iterator[RunningServer]:
    """Load the model, serve it on a free port of 127.0.0.1, and stop it afterwards."""
    engine = AsyncEngine.from_options(model_path, **{**SERVER_ENGINE_OPTIONS, **engine_options})
    server = build_server(create_app(engine, config), config, abort_in_flight=engine.shutdown)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    host, port = sock.getsockname()
    try:
        yield RunningServer(f"http://{host}:{port}", engine, server)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
        _clear_fastapi_callable_caches()


def _clear_fastapi_callable_caches() -> None:
    """FastAPI keeps every endpoint it has classified in process-wide caches (thousands of
    entries), and an app's endpoints close over its engine: without this a test process keeps
    every stopped server's weights and KV cache (a GB each), as one serving process never does."""
    from fastapi.dependencies import models

    for value in vars(models).values():
        if callable(getattr(value, "cache_clear", None)):
            value.cache_clear()
