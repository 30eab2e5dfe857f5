"""An asyncio load client for any OpenAI-compatible server (firsttoken, vLLM, llama.cpp).

Requests leave at Poisson arrival times (or all at once), optionally capped by a concurrency
limit, and stream their reply; the client stamps every content chunk as it arrives.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np

from firsttoken.bench.datasets import BenchPrompt
from firsttoken.bench.server_counters import ServerCounters, read_counters
from firsttoken.bench.serve_stats import RequestRecord
from firsttoken.progress import progress_bar

COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"


@dataclass(frozen=True)
class ServeTarget:
    """The server under test and how to talk to it."""

    base_url: str
    endpoint: str = COMPLETIONS
    model: str | None = None  # None: the first model the server lists
    ignore_eos: bool = False  # ask for exactly max_tokens (vLLM, llama.cpp and firsttoken honour it)
    timeout_s: float = 600.0  # longest wait for a connection or for the next bytes of a reply

    def __post_init__(self) -> None:
        if self.endpoint not in (COMPLETIONS, CHAT_COMPLETIONS):
            raise ValueError(f"endpoint: must be {COMPLETIONS} or {CHAT_COMPLETIONS}, got {self.endpoint!r}")


@dataclass(frozen=True)
class LoadShape:
    """When requests leave: a Poisson process at `request_rate` per second (inf: all at once)."""

    request_rate: float = math.inf
    max_concurrency: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.request_rate > 0:
            raise ValueError(f"request_rate: must be > 0 or inf, got {self.request_rate}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency: must be >= 1, got {self.max_concurrency}")


@dataclass(frozen=True)
class Clock:
    """Where the client reads the time and how it waits for an arrival; tests pass a scripted
    one, so what they check holds however busy the machine is."""

    now: Callable[[], float] = time.perf_counter
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep


SYSTEM_CLOCK = Clock()


@dataclass(frozen=True)
class ServeRun:
    """The records of one benchmark run, in prompt order, and how long the run took."""

    model: str
    records: list[RequestRecord]
    duration_s: float
    # The server's counters over the run (None where it exports none of ours).
    server_counters: ServerCounters | None = None


def arrival_offsets(num_requests: int, request_rate: float, seed: int) -> list[float]:
    """Seconds from the run's start at which each request leaves: exponential gaps of mean
    1 / rate (a Poisson process); the first request leaves at once."""
    if math.isinf(request_rate):
        return [0.0] * num_requests
    gaps = np.random.default_rng(seed).exponential(1.0 / request_rate, size=num_requests)
    gaps[0] = 0.0
    return np.cumsum(gaps).tolist()


async def run_load(
    target: ServeTarget,
    shape: LoadShape,
    prompts: Sequence[BenchPrompt],
    show_progress: bool = True,
    clock: Clock = SYSTEM_CLOCK,
) -> ServeRun:
    limits = httpx.Limits(
        max_connections=shape.max_concurrency or len(prompts), max_keepalive_connections=None
    )
    async with httpx.AsyncClient(base_url=target.base_url, timeout=target.timeout_s, limits=limits) as client:
        model = target.model or await first_listed_model(client)
        counters_before = await read_counters(client)
        gate = asyncio.Semaphore(shape.max_concurrency or len(prompts))
        with progress_bar(len(prompts), "requests", "req", show_progress) as bar:
            run_start = clock.now()

            async def send(prompt: BenchPrompt) -> RequestRecord:
                async with gate:
                    record = await stream_one(client, target, model, prompt, run_start, clock)
                bar.update(1)
                return record

            tasks = []
            offsets = arrival_offsets(len(prompts), shape.request_rate, shape.seed)
            for prompt, offset in zip(prompts, offsets, strict=True):
                delay = run_start + offset - clock.now()
                if delay > 0:
                    await clock.sleep(delay)
                tasks.append(asyncio.create_task(send(prompt)))
            records = await asyncio.gather(*tasks)
            duration = clock.now() - run_start
        counters_after = await read_counters(client)
    counters = None
    if counters_before is not None and counters_after is not None:
        counters = counters_after.minus(counters_before)
    return ServeRun(model, list(records), duration, counters)


async def first_listed_model(client: httpx.AsyncClient) -> str:
    try:
        response = await client.get("/v1/models")
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as error:
        raise ValueError(f"model: no --model given and GET /v1/models gave none ({error})") from error


def request_body(target: ServeTarget, model: str, prompt: BenchPrompt) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": prompt.max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if target.ignore_eos:
        body["ignore_eos"] = True
    if target.endpoint == CHAT_COMPLETIONS:
        body["messages"] = [{"role": "user", "content": prompt.text}]
    else:
        body["prompt"] = prompt.text
    return body


async def stream_one(
    client: httpx.AsyncClient,
    target: ServeTarget,
    model: str,
    prompt: BenchPrompt,
    run_start: float,
    clock: Clock = SYSTEM_CLOCK,
) -> RequestRecord:
    body = request_body(target, model, prompt)
    start = clock.now()
    record = RequestRecord(start_s=start - run_start, num_prompt_tokens=prompt.num_prompt_tokens)
    last_chunk = start
    num_content_chunks = 0
    usage: dict[str, Any] = {}
    try:
        async with client.stream("POST", target.endpoint, json=body) as response:
            if response.status_code != 200:
                record.error = (
                    f"HTTP {response.status_code}: {(await response.aread()).decode(errors='replace')[:200]}"
                )
                return record
            async for line in response.aiter_lines():
                payload = sse_data(line)
                if payload is None:
                    continue
                if payload == "[DONE]":
                    break
                chunk = json.loads(payload)
                usage = chunk.get("usage") or usage
                if not chunk_content(chunk):
                    continue
                now = clock.now()
                if num_content_chunks == 0:
                    record.ttft_s = now - start
                else:
                    record.itl_s.append(now - last_chunk)
                last_chunk = now
                num_content_chunks += 1
    except (httpx.HTTPError, json.JSONDecodeError) as error:
        record.error = f"{type(error).__name__}: {error}"
        return record
    if num_content_chunks == 0:
        record.error = "the stream ended without content"
        return record
    record.success = True
    record.latency_s = last_chunk - start
    # Without usage (a server that ignores include_usage), count one token per content chunk.
    record.num_output_tokens = usage.get("completion_tokens") or num_content_chunks
    record.num_prompt_tokens = usage.get("prompt_tokens") or prompt.num_prompt_tokens
    return record


def sse_data(line: str) -> str | None:
    """The data of one SSE line, or None for blank lines, comments and other fields."""
    if not line.startswith("data:"):
        return None
    return line[len("data:") :].strip()


def chunk_content(chunk: dict[str, Any]) -> str:
    """The generated text a completions or chat-completions chunk carries ('' for none)."""
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "delta" in choice:
        delta = choice["delta"] or {}
        return delta.get("content") or delta.get("reasoning_content") or ""
    return choice.get("text") or ""
