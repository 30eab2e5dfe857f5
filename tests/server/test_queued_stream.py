"""A stream whose request waits for the engine: SSE comments keep its connection alive until the
first chunk, and its client leaving ends the request. The engine here never produces a token."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import pytest

from firsttoken.engine import InvalidInputError, TokenizedPrompt
from firsttoken.outputs import EngineStats, RequestDelta
from firsttoken.sampling_params import SamplingParams
from firsttoken.server import sse
from firsttoken.server.app import create_app
from firsttoken.server.server_config import ServerConfig
from firsttoken.server.streaming import with_keepalives

INTERVAL_S = 0.01


class _Tokenizer:
    def longest_token_bytes(self) -> int:
        return 16


@dataclass
class _QueuedStream:
    """A request that stays queued: no delta ever comes; `closed` once the server aborted it."""

    req_id: str
    first_token_time: float | None = None
    closed: asyncio.Event = field(default_factory=asyncio.Event)

    async def __aiter__(self) -> AsyncIterator[RequestDelta]:
        await asyncio.Event().wait()
        yield  # an async generator that never gets here

    async def aclose(self) -> None:
        self.closed.set()


class _QueueingEngine:
    """An engine client whose every request is admitted and then waits for ever."""

    tokenizer = _Tokenizer()
    max_model_len = 64
    max_request_tokens = 64
    max_waiting_requests = None

    def __init__(self) -> None:
        self.streams: list[_QueuedStream] = []

    def add_observer(self, observer: Any) -> None:
        pass

    def stats(self) -> EngineStats:
        raise AssertionError("not scraped here")

    async def tokenize(self, prompt: str) -> TokenizedPrompt:
        return TokenizedPrompt([1, 2, 3], arrival_time=0.0, tokenized_time=0.0)

    async def add_request(self, prompt: TokenizedPrompt, params: SamplingParams, **_: Any) -> _QueuedStream:
        stream = _QueuedStream(f"queued-{len(self.streams)}")
        self.streams.append(stream)
        return stream


class _Client:
    """An ASGI client of one streamed completion: leaves once it has read `num_keepalives`
    comments, and records every body it was sent."""

    def __init__(self, num_keepalives: int) -> None:
        self.num_keepalives = num_keepalives
        self.messages: list[dict[str, Any]] = []
        self.leave = asyncio.Event()
        self._body_sent = False

    async def receive(self) -> dict[str, Any]:
        if not self._body_sent:
            self._body_sent = True
            body = json.dumps({"prompt": "Hi", "max_tokens": 4, "stream": True}).encode()
            return {"type": "http.request", "body": body, "more_body": False}
        await self.leave.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        self.messages.append(message)
        if self.bodies().count(sse.KEEPALIVE) >= self.num_keepalives:
            self.leave.set()

    def bodies(self) -> list[bytes]:
        return [message["body"] for message in self.messages if message["type"] == "http.response.body"]


def _completion_scope() -> dict[str, Any]:
    return {
        "type": "http",
        # 2.4: Starlette's own StreamingResponse would not watch for the disconnect here.
        "asgi": {"version": "3.0", "spec_version": "2.4"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
    }


def test_a_queued_stream_sends_keepalive_comments_and_its_client_leaving_aborts_it():
    engine = _QueueingEngine()
    app = create_app(engine, ServerConfig(stream_keepalive_s=INTERVAL_S, web_ui=False))
    client = _Client(num_keepalives=3)

    async def scenario() -> None:
        await asyncio.wait_for(app(_completion_scope(), client.receive, client.send), 60)
        await asyncio.wait_for(engine.streams[0].closed.wait(), 60)

    asyncio.run(scenario())
    assert client.messages[0]["type"] == "http.response.start"
    assert client.messages[0]["status"] == 200
    bodies = [body for body in client.bodies() if body]
    assert len(bodies) >= 3 and set(bodies) == {sse.KEEPALIVE}


def test_keepalives_stop_at_the_first_event():
    async def events(first_sent: asyncio.Event) -> AsyncIterator[bytes]:
        await first_sent.wait()
        yield b"data: 1\n\n"
        yield b"data: 2\n\n"

    async def scenario() -> list[bytes]:
        first_sent = asyncio.Event()
        received = []
        async for event in with_keepalives(events(first_sent), INTERVAL_S):
            received.append(event)
            if received.count(sse.KEEPALIVE) == 2:
                first_sent.set()
        return received

    received = asyncio.run(scenario())
    first = received.index(b"data: 1\n\n")
    assert first >= 2 and set(received[:first]) == {sse.KEEPALIVE}
    assert received[first:] == [b"data: 1\n\n", b"data: 2\n\n"]


def test_closing_a_waiting_stream_ends_its_pending_read():
    ended = []

    async def events() -> AsyncIterator[bytes]:
        try:
            await asyncio.Event().wait()
            yield b"data: never\n\n"
        finally:
            ended.append(True)

    async def scenario() -> None:
        stream = with_keepalives(events(), INTERVAL_S)
        assert await anext(stream) == sse.KEEPALIVE
        await stream.aclose()

    asyncio.run(scenario())
    assert ended == [True]


@pytest.mark.parametrize("interval_s", [0.0, -1.0, float("nan"), float("inf"), 1e308])
def test_the_keepalive_interval_is_a_positive_finite_number(interval_s):
    message = r"^stream_keepalive_s: must be a finite number in \(0, 86400\]"
    with pytest.raises(InvalidInputError, match=message):
        ServerConfig(stream_keepalive_s=interval_s)
