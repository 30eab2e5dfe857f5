"""Batch invariance as a client sees it: 16 concurrent copies of one greedy request,
mixed with random other traffic, all answer what the request answers alone."""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest

from firsttoken.server.server_config import ServerConfig
from tests.conftest import may_claim_batch_invariance
from tests.server.conftest import MODEL_NAME, running_server

QUESTION = "Explain in two sentences why the sky is blue and sunsets are red."
NUM_COPIES = 16


def _body(prompt: str, max_tokens: int, temperature: float) -> dict:
    return {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "logprobs": 1,
        "ignore_eos": True,
    }


def _answer(reply: dict) -> tuple:
    choice = reply["choices"][0]
    return choice["text"], tuple(choice["logprobs"]["token_logprobs"])


@pytest.fixture(scope="module")
def invariant_server(model_path):
    """bf16 where this CPU may claim invariance in it (AVX512-BF16 kernels), else float32 (the
    native kernels' claim on every ISA)."""
    dtype = "bfloat16" if may_claim_batch_invariance("bfloat16") else "float32"
    with running_server(
        model_path,
        ServerConfig(port=0, served_model_names=(MODEL_NAME,)),
        dtype=dtype,
        batch_invariant=True,
        chunk_size="auto",
    ) as running:
        if not running.engine.inspect().batch_invariant:
            pytest.skip(f"no {dtype} batch invariance on this machine (no native kernels built)")
        yield running


def test_concurrent_copies_and_random_traffic_all_get_the_alone_answer(invariant_server):
    url = invariant_server.base_url + "/v1/completions"
    rng = random.Random(5)
    words = ["cat", "river", "moon", "quantum", "bread", "system", "galaxy", "tea"]
    traffic = [
        _body(" ".join(rng.choice(words) for _ in range(rng.randrange(5, 300))), rng.randrange(4, 40), 0.8)
        for _ in range(12)
    ]
    with httpx.Client(timeout=300) as client:
        alone = _answer(client.post(url, json=_body(QUESTION, 20, 0)).json())

    async def send_all() -> list[dict]:
        async with httpx.AsyncClient(timeout=300) as client:
            bodies = [_body(QUESTION, 20, 0)] * NUM_COPIES + traffic
            rng.shuffle(bodies)
            replies = await asyncio.gather(*(client.post(url, json=body) for body in bodies))
            return [reply.json() for reply, body in zip(replies, bodies) if body["temperature"] == 0]

    copies = asyncio.run(send_all())
    assert len(copies) == NUM_COPIES
    assert all(_answer(reply) == alone for reply in copies)
    assert invariant_server.engine.stats().num_preemptions == 0  # a recompute is not covered yet
