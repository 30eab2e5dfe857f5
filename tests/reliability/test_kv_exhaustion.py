"""A KV cache far too small for the load: requests are preempted and resumed, or refused with
429 when the queue is full; every 200 is a complete answer, and nothing stays allocated."""

from __future__ import annotations

import asyncio

import httpx
import orjson
import pytest

from firsttoken.server.server_config import ServerConfig
from tests.server.conftest import MODEL_NAME, running_server

# The 2-layer model of SmolLM2-135M's shapes in float32 takes 48 KiB a 16-token block: about 12
# blocks, three requests' worth.
TINY_KV_BYTES = 576 << 10
MAX_TOKENS = 48
NUM_CLIENTS = 16


@pytest.fixture(scope="module")
def tiny_kv_server(two_layer_model_path):
    config = ServerConfig(port=0, served_model_names=(MODEL_NAME,))
    options = dict(
        kv_cache_memory_bytes=TINY_KV_BYTES,
        max_model_len=128,
        max_num_seqs=8,
        max_waiting_requests=4,
        chunk_size=32,
    )
    with running_server(two_layer_model_path, config, **options) as running:
        assert running.engine.stats().num_kv_blocks * 16 < 4 * (MAX_TOKENS + 16), "the cache must be tight"
        yield running


async def _whole(client: httpx.AsyncClient, index: int) -> str:
    body = {"prompt": f"Client {index} counts:", "max_tokens": MAX_TOKENS, "ignore_eos": True}
    response = await client.post("/v1/completions", json=body)
    if response.status_code == 429:
        return "refused"
    assert response.status_code == 200, response.text
    (choice,) = response.json()["choices"]
    assert choice["finish_reason"] == "length"
    assert response.json()["usage"]["completion_tokens"] == MAX_TOKENS
    return "complete"


async def _streamed(client: httpx.AsyncClient, index: int) -> str:
    body = {"prompt": f"Client {index} counts:", "max_tokens": MAX_TOKENS, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code == 429:
            return "refused"
        assert response.status_code == 200
        events = [line async for line in response.aiter_lines() if line]
    assert events[-1] == "data: [DONE]"
    chunks = [orjson.loads(event.removeprefix("data: ")) for event in events[:-1]]
    assert all("error" not in chunk for chunk in chunks), chunks[-1]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == MAX_TOKENS
    return "complete"


def test_an_exhausted_kv_cache_gives_complete_answers_or_429s(tiny_kv_server):
    start = tiny_kv_server.engine.stats()

    async def run_all() -> list[str]:
        async with httpx.AsyncClient(base_url=tiny_kv_server.base_url, timeout=120) as client:
            return await asyncio.gather(
                *((_streamed if index % 2 else _whole)(client, index) for index in range(NUM_CLIENTS))
            )

    outcomes = asyncio.run(run_all())
    assert outcomes.count("complete") >= 4, outcomes
    num_preemptions = tiny_kv_server.engine.stats().num_preemptions - start.num_preemptions
    assert num_preemptions > 0, "the cache was never exhausted"
    tiny_kv_server.wait_for_idle_kv(since=start)
