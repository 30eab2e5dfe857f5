"""Admission knows what a request needs and what it can ever get: pins always leave room for a
request of max_model_len (so none waits for someone to unpin; the scheduler's own refusal of a
request that cannot fit beside pinned blocks is in tests/core), and a request that waits past
max_queue_wait_s ends with a clear error, holding nothing."""

from __future__ import annotations

import httpx
import orjson
import pytest

from firsttoken.server.server_config import ServerConfig
from tests.http_client import HTTP
from tests.server.conftest import MODEL_NAME, running_server

# SmolLM2-135M in float32 takes 720 KiB a 16-token block: 54 blocks, of which pins may hold 27 by
# their share; a request of max_model_len needs ceil(max_model_len / 16) beside them.
KV_BYTES = 40_000_000
BIG_REQUEST = {"prompt": "x " * 500, "max_tokens": 40, "ignore_eos": True}


def _system_prompt(index: int) -> str:
    return f"Pin number {index}. " + "alpha beta gamma " * 40


def _pin(base_url: str, index: int) -> httpx.Response:
    return HTTP.post(base_url + "/v1/pins", json={"system_prompt": _system_prompt(index)}, timeout=60)


def _unpin_all(base_url: str) -> None:
    for pin in HTTP.get(base_url + "/v1/pins").json()["data"]:
        HTTP.delete(base_url + f"/v1/pins/{pin['id']}")


@pytest.mark.slow  # the boundary where pins stop is checked by default just below
def test_no_pin_when_the_cache_cannot_hold_a_request_of_max_model_len(model_path):
    """max_model_len 2048 (128 blocks) beside a 54-block cache: no pin may start, so a request
    that fits the cache is never left waiting behind pins."""
    config = ServerConfig(port=0, served_model_names=(MODEL_NAME,))
    with running_server(model_path, config, kv_cache_memory_bytes=KV_BYTES, max_model_len=2048) as running:
        refused = _pin(running.base_url, 0)
        assert refused.status_code == 400, refused.text
        assert "a request of max_model_len (2048 tokens)" in refused.json()["error"]["message"]
        served = HTTP.post(running.base_url + "/v1/completions", json=BIG_REQUEST, timeout=120)
        assert served.status_code == 200, served.text


@pytest.fixture(scope="module")
def pinning_server(model_path):
    """max_model_len 576 (36 blocks) beside 54: pins may hold 18 blocks."""
    config = ServerConfig(port=0, served_model_names=(MODEL_NAME,))
    with running_server(model_path, config, kv_cache_memory_bytes=KV_BYTES, max_model_len=576) as running:
        yield running


def test_pins_stop_where_a_request_of_max_model_len_would_no_longer_fit(pinning_server):
    base_url = pinning_server.base_url
    try:
        pins = [_pin(base_url, index) for index in range(3)]
        statuses = [pin.status_code for pin in pins]
        assert statuses[0] == 200 and 400 in statuses, [pin.text for pin in pins]
        refused = pins[statuses.index(400)].json()["error"]
        assert "a request of max_model_len (576 tokens)" in refused["message"], refused
        stats = pinning_server.engine.stats()
        num_pinned_blocks = stats.num_kv_blocks - stats.num_free_kv_blocks
        assert num_pinned_blocks + 576 // 16 <= stats.num_kv_blocks
        longest = {"prompt": list(range(1000, 1000 + 576 - 40)), "max_tokens": 40, "ignore_eos": True}
        served = HTTP.post(base_url + "/v1/completions", json=longest, timeout=120)
        assert served.status_code == 200, served.text
        after = pinning_server.engine.stats()
        assert after.num_kv_blocks - after.num_free_kv_blocks == num_pinned_blocks
        assert after.num_waiting == 0 and after.num_running == 0
    finally:
        _unpin_all(base_url)


@pytest.fixture(scope="module")
def one_slot_server(model_path):
    """One request runs at a time; the others may wait a quarter of a second."""
    config = ServerConfig(port=0, served_model_names=(MODEL_NAME,))
    with running_server(
        model_path, config, max_num_seqs=1, max_queue_wait_s=0.25, max_model_len=512
    ) as running:
        yield running


def test_a_request_waiting_past_max_queue_wait_ends_with_an_error_and_holds_nothing(one_slot_server):
    start = one_slot_server.engine.stats()
    base_url = one_slot_server.base_url
    hog = {"prompt": "Count:", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with HTTP.stream("POST", base_url + "/v1/completions", json=hog, timeout=120) as running:
        lines = running.iter_lines()
        assert next(line for line in lines if line).startswith("data: {")  # it holds the only slot
        waited = HTTP.post(base_url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4}, timeout=60)
        assert waited.status_code == 503, waited.text
        assert waited.json()["error"]["code"] == "queue_timeout"
        assert "max_queue_wait_s" in waited.json()["error"]["message"]
        streamed = {"prompt": "Hi", "max_tokens": 4, "stream": True}
        with HTTP.stream("POST", base_url + "/v1/completions", json=streamed, timeout=60) as response:
            events = [line.removeprefix("data: ") for line in response.iter_lines() if line]
        assert events[-1] == "[DONE]"
        assert orjson.loads(events[-2])["error"]["code"] == "queue_timeout"
        assert orjson.loads(events[-3])["choices"][0]["finish_reason"] == "error"
    one_slot_server.wait_for_idle_kv(timeout_s=10.0, since=start)


def test_a_request_predicted_to_miss_its_ttft_objective_gets_429_and_holds_nothing(two_layer_model_path):
    """A 1 ms objective no prefill can meet, under the refuse policy: a 429 with the engine's
    Retry-After, nothing held; a request carrying a generous objective of its own is served.
    (The 2-layer model: the objective needs the step-cost model, measured at start.)"""
    config = ServerConfig(port=0, served_model_names=(MODEL_NAME,))
    options = dict(ttft_slo_ms=1, slo_policy="refuse", max_model_len=512)
    with running_server(two_layer_model_path, config, **options) as running:
        start = running.engine.stats()
        body = {"prompt": "Once upon a time", "max_tokens": 4}
        refused = HTTP.post(running.base_url + "/v1/completions", json=body, timeout=60)
        assert refused.status_code == 429, refused.text
        error = refused.json()["error"]
        assert error["code"] == "ttft_slo_unattainable"
        assert error["message"].startswith("ttft_slo_ms: the first token is predicted in")
        assert int(refused.headers["Retry-After"]) >= 1
        stats = running.engine.stats()
        assert (stats.num_waiting, stats.num_running) == (0, 0)
        assert stats.num_free_kv_blocks == stats.num_kv_blocks
        generous = {**body, "ttft_slo_ms": 600_000}
        served = HTTP.post(running.base_url + "/v1/completions", json=generous, timeout=60)
        assert served.status_code == 200, served.text
        assert running.metric("firsttoken:num_ttft_slo_refusals_total") == 1
        assert running.metric("firsttoken:ttft_slo_requests_total", outcome="met") == 1
        assert running.metric("firsttoken:ttft_prediction_error_seconds_count") == 1
        bad = HTTP.post(running.base_url + "/v1/completions", json={**body, "ttft_slo_ms": 0}, timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "ttft_slo_ms", bad.text
        running.wait_for_idle_kv(since=start)
