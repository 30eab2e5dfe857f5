"""A fake OpenAI-compatible server that streams scripted chunks after scripted delays.

It runs uvicorn on a free 127.0.0.1 port in a background thread, so a client under test in
the main thread sees real HTTP and SSE. The delays are real sleeps, or, with a scripted clock,
moves of that clock: a client reading the same clock then measures them exactly.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from tests.bench.scripted_clock import ScriptedClock

MODEL_NAME = "fake-model"


@dataclass(frozen=True)
class Script:
    """What every streamed reply does: wait `ttft_s`, send a content chunk, then one more
    after each gap; usage reports `tokens_per_chunk` tokens per content chunk.

    With a `clock`, a wait moves the clock instead of sleeping, and each content chunk waits
    for the client to read the clock (to stamp it) before the next move; such a server serves
    one request at a time (the clock is shared)."""

    ttft_s: float
    gaps_s: tuple[float, ...]
    tokens_per_chunk: int = 1
    status_code: int = 200
    clock: ScriptedClock | None = None


@dataclass
class ServerState:
    """What the fake server saw: request bodies and the most requests in flight at once."""

    bodies: list[dict] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0


def _sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


def build_app(script: Script, state: ServerState) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": MODEL_NAME, "object": "model"}]}

    async def wait(delay_s: float) -> int:
        """Let `delay_s` pass; returns how often the clock was read by then (0 without one)."""
        if script.clock is None:
            await asyncio.sleep(delay_s)
            return 0
        script.clock.advance(delay_s)
        return script.clock.num_reads

    async def stream(body: dict, is_chat: bool) -> AsyncIterator[str]:
        def content_chunk(text: str) -> dict:
            choice = {"index": 0, "delta": {"content": text}} if is_chat else {"index": 0, "text": text}
            return {"choices": [choice]}

        state.in_flight += 1
        state.max_in_flight = max(state.max_in_flight, state.in_flight)
        try:
            # A content-less first chunk (a chat role, an empty text) must not count as the first token.
            yield _sse(
                {
                    "choices": [
                        {"index": 0, "delta": {"role": "assistant"}} if is_chat else {"index": 0, "text": ""}
                    ]
                }
            )
            for index, delay in enumerate((script.ttft_s, *script.gaps_s)):
                num_reads = await wait(delay)
                yield _sse(content_chunk(" next" if index else "first"))
                if script.clock is not None:
                    await script.clock.wait_for_read_after(num_reads)
            num_tokens = (len(script.gaps_s) + 1) * script.tokens_per_chunk
            yield _sse({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": num_tokens}})
            yield _sse("[DONE]")
        finally:
            state.in_flight -= 1

    async def handle(request: Request, is_chat: bool):
        body = await request.json()
        state.bodies.append(body)
        if script.status_code != 200:
            return JSONResponse({"error": "scripted failure"}, status_code=script.status_code)
        return StreamingResponse(stream(body, is_chat), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, is_chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, is_chat=True)

    return app


@dataclass
class RunningServer:
    """A started fake server: its URL and what it saw."""

    base_url: str
    state: ServerState


def serve_in_thread(script: Script) -> Iterator[RunningServer]:
    """Generator for a pytest fixture: start, yield the running server, stop."""
    state = ServerState()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(build_app(script, state), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("the fake server did not start within 10 s")
        time.sleep(0.01)
    try:
        yield RunningServer(f"http://127.0.0.1:{port}", state)
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
