"""Admission knows what a request needs and what it can ever get: a request that cannot fit
beside the pinned prefixes is refused at once (not left waiting until someone unpins), and a
request that waits past max_queue_wait_s ends with a clear error, holding nothing."""

from __future__ import annotations

import httpx
import orjson
import pytest

from firsttoken.server.config import ServerConfig
from tests.server.conftest import MODEL_NAME, running_server

# SmolLM2-135M in float32 takes 720 KiB a 16-token block: 54 blocks, of which pins may hold 27.
KV_BYTES = 40_000_000
BIG_REQUEST = {"prompt": "x " * 500, "max_tokens": 40, "ignore_eos": True}


def _system_prompt(index: int) -> str:
    return f"Pin number {index}. " + "alpha beta gamma " * 40


@pytest.fixture(scope="module")
def pinning_server(model_path):
    config = ServerConfig(port=0, served_model_names=(MODEL_NAME,))
    with running_server(model_path, config, kv_cache_memory_bytes=KV_BYTES, max_model_len=2048) as running:
        yield running


def test_a_request_that_cannot_fit_beside_the_pins_is_refused_at_once(pinning_server):
    base_url = pinning_server.base_url
    pins = [
        httpx.post(base_url + "/v1/pins", json={"system_prompt": _system_prompt(i)}, timeout=60)
        for i in range(3)
    ]
    assert [pin.status_code for pin in pins] == [200, 200, 200], pins[-1].text
    try:
        stats = pinning_server.engine.stats()
        num_pinned_blocks = stats.num_kv_blocks - stats.num_free_kv_blocks
        # A client timeout, not a duration claim: before the fix this request waited forever.
        refused = httpx.post(base_url + "/v1/completions", json=BIG_REQUEST, timeout=30)
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["param"] == "max_tokens"
        assert f"pinned prefixes hold {num_pinned_blocks} of the {stats.num_kv_blocks}" in error["message"]
        fits = httpx.post(
            base_url + "/v1/completions", json={**BIG_REQUEST, "prompt": "x " * 100}, timeout=60
        )
        assert fits.status_code == 200, fits.text
        after = pinning_server.engine.stats()
        assert after.num_kv_blocks - after.num_free_kv_blocks == num_pinned_blocks
        assert after.num_waiting == 0 and after.num_running == 0
    finally:
        for pin in pins:
            if pin.status_code == 200:
                httpx.delete(base_url + f"/v1/pins/{pin.json()['id']}")
    served = httpx.post(base_url + "/v1/completions", json=BIG_REQUEST, timeout=120)
    assert served.status_code == 200, served.text


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
    with httpx.stream("POST", base_url + "/v1/completions", json=hog, timeout=120) as running:
        lines = running.iter_lines()
        assert next(line for line in lines if line).startswith("data: {")  # it holds the only slot
        waited = httpx.post(base_url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4}, timeout=60)
        assert waited.status_code == 503, waited.text
        assert waited.json()["error"]["code"] == "queue_timeout"
        assert "max_queue_wait_s" in waited.json()["error"]["message"]
        streamed = {"prompt": "Hi", "max_tokens": 4, "stream": True}
        with httpx.stream("POST", base_url + "/v1/completions", json=streamed, timeout=60) as response:
            events = [line.removeprefix("data: ") for line in response.iter_lines() if line]
        assert events[-1] == "[DONE]"
        assert orjson.loads(events[-2])["error"]["code"] == "queue_timeout"
        assert orjson.loads(events[-3])["choices"][0]["finish_reason"] == "error"
    one_slot_server.wait_for_idle_kv(timeout_s=10.0, since=start)
