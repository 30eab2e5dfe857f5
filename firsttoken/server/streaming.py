"""Running a response's generation to the end: as server-sent events, or collected whole.

Both stop generating when the client goes away. The route that starts a generation watches for
the disconnect from the start of the request (tokenizing, waiting for admission, a whole reply's
generation), so a request whose client left while it queued is aborted before any step runs it;
a stream's body watches for it itself while it is sent, and sends SSE comments until its first
chunk so that a client's read timeout does not end a stream that queues.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, AsyncIterator, Awaitable, Callable, Coroutine, TypeVar

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from firsttoken.server import sse
from firsttoken.server.errors import APIError, from_exception
from firsttoken.server.generation import Generation
from firsttoken.server.reply import Reply
from firsttoken.server.server_config import ServerConfig

T = TypeVar("T")

# The status nginx logs for a request whose client closed the connection; nobody reads it.
CLIENT_CLOSED_REQUEST = 499


class ClientDisconnected(Exception):
    """The client closed the connection before its response was complete."""


async def respond(
    generation: Generation, reply: Reply, stream: bool, include_usage: bool, config: ServerConfig
) -> Response:
    """The started generation as server-sent events, or, run to its end, as one JSON body."""
    if stream:
        events = stream_events(generation, reply, include_usage, config.retry_after_s)
        return EventStreamResponse(generation, with_keepalives(events, config.stream_keepalive_s))
    await collect(generation)
    failure = generation_failure(generation)
    if failure is not None:
        return failure.response()
    return Response(
        reply.whole(generation).model_dump_json(),
        media_type="application/json",
        headers={"Server-Timing": generation.server_timing()},
    )


async def respond_unless_disconnected(request: Request, work: Coroutine[Any, Any, Response]) -> Response:
    """`work`'s response, or a 499 if the client disconnects first: `work` is then cancelled,
    which aborts whatever it submitted to the engine."""
    try:
        return await unless_disconnected(request.receive, work)
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED_REQUEST)


class EventStreamResponse(StreamingResponse):
    """A started generation's server-sent events. Watches for the client's disconnect from its
    first byte whatever the ASGI server's spec version (under 2.4 Starlette's StreamingResponse
    only notices it when a send fails, which a queued stream never makes), and ends the
    generation however the response ends, even when its body never started."""

    def __init__(self, generation: Generation, events: AsyncIterator[bytes]) -> None:
        super().__init__(events, media_type=sse.MEDIA_TYPE, headers=sse.HEADERS)
        self.generation = generation

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await unless_disconnected(receive, self._send_events(send))
        except (ClientDisconnected, OSError):  # OSError: a send after the disconnect (ASGI 2.4)
            pass  # nobody is left to tell
        finally:
            await self.generation.close()

    async def _send_events(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async with contextlib.aclosing(self.body_iterator) as events:
            async for event in events:
                await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def stream_events(
    generation: Generation, reply: Reply, include_usage: bool, retry_after_s: int
) -> AsyncIterator[bytes]:
    """The SSE body: a chunk per delta with something to show, the usage chunk if asked, [DONE].

    The TTFT extension rides on the usage chunk, or without one on the last chunk.
    """
    try:
        async with contextlib.aclosing(generation.deltas()) as deltas:
            async for choice, delta in deltas:
                is_last = generation.finished
                extension = generation.ttft_extension() if is_last and not include_usage else None
                chunk = reply.chunk(choice, delta, extension)
                if chunk is not None:
                    choice.num_chunks_sent += 1
                    yield sse.model_event(chunk, include_usage)
        failure = generation_failure(generation)
        if failure is not None:  # its choice's chunk said finish_reason "error"; this says why
            yield sse.event(failure.body())
        elif include_usage:
            usage_chunk = reply.usage_chunk(generation.usage(), generation.ttft_extension())
            yield sse.model_event(usage_chunk, include_usage)
    except Exception as error:  # the engine stopped mid-stream: say so in-band, then end
        yield sse.event(from_exception(error, retry_after_s).body())
    finally:
        # Before [DONE]: the choices still running after an error stop now.
        await generation.close()
    yield sse.DONE


async def with_keepalives(events: AsyncIterator[bytes], interval_s: float) -> AsyncIterator[bytes]:
    """`events`, after an SSE comment each `interval_s` that passes before the first one: a
    queued stream otherwise sends nothing after its headers, and a client (or a proxy) whose read
    timeout is shorter than the queue's wait gives up on it."""
    first = asyncio.ensure_future(anext(events, None))
    try:
        while not (await asyncio.wait({first}, timeout=interval_s))[0]:
            yield sse.KEEPALIVE
    finally:
        if not first.done():  # closed early (the client left): the pending read ends first
            await _cancel_and_wait(first)
    event = first.result()
    if event is None:
        return
    yield event
    async for event in events:
        yield event


def generation_failure(generation: Generation) -> APIError | None:
    """The error of the first choice that ended with finish_reason "error" (it waited past
    max_queue_wait_s, or its output constraint failed mid-generation), or None."""
    for choice in generation.choices:
        if choice.output.finish_reason != "error":
            continue
        message = f"choice {choice.index}: {choice.output.stop_reason}"
        # The engine's reason names what ended it first, as "field: why".
        if str(choice.output.stop_reason).startswith("max_queue_wait_s:"):
            return APIError(503, message, "server_error", code="queue_timeout")
        return APIError(400, message, code="generation_failed")
    return None


async def collect(generation: Generation) -> None:
    """Run every choice to its end; whatever ends it early (the client leaving cancels it)
    aborts the choices still running."""
    try:
        await generation.run_to_completion()
    finally:
        await generation.close()


async def unless_disconnected(receive: Callable[[], Awaitable[Message]], work: Coroutine[Any, Any, T]) -> T:
    """`work`'s result, unless the client disconnects first: then `work` is cancelled, has run
    its clean-up, and ClientDisconnected is raised.

    The request's body is already read, so the next receive() returns only when the client goes.
    """

    async def wait_for_disconnect() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.create_task(wait_for_disconnect())
    try:
        await asyncio.wait({work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        await _cancel_and_wait(watch_task)
        if not work_task.done():
            # A cancelled task has no result until it has run its cancellation to the end.
            await _cancel_and_wait(work_task)
    if work_task.cancelled():
        raise ClientDisconnected
    return work_task.result()


async def _cancel_and_wait(task: asyncio.Future) -> None:
    """Cancel `task` and wait until it has ended (asyncio.wait raises nothing of the task's)."""
    task.cancel()
    await asyncio.wait({task})
