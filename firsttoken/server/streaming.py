"""Running a response's generation to the end: as server-sent events, or collected whole.

Both stop generating when the client goes away: a stream's body is cancelled by the ASGI
server on disconnect; a non-streamed reply watches for the disconnect itself.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator, Coroutine

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from firsttoken.server import sse
from firsttoken.server.errors import APIError, from_exception
from firsttoken.server.generation import Generation
from firsttoken.server.reply import Reply


async def respond(
    generation: Generation,
    reply: Reply,
    stream: bool,
    include_usage: bool,
    retry_after_s: int,
    request: Request,
) -> Response:
    """The started generation as server-sent events, or, run to its end, as one JSON body."""
    if stream:
        events = stream_events(generation, reply, include_usage, retry_after_s)
        return StreamingResponse(events, media_type=sse.MEDIA_TYPE, headers=sse.HEADERS)
    if not await collect(generation, request):
        return Response(status_code=499)  # client closed the request; nobody reads this
    failure = generation_failure(generation)
    if failure is not None:
        return failure.response()
    return Response(
        reply.whole(generation).model_dump_json(),
        media_type="application/json",
        headers={"Server-Timing": generation.server_timing()},
    )


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
        await generation.close()
    yield sse.DONE


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


async def collect(generation: Generation, request: Request) -> bool:
    """Run every choice to its end; False if the client disconnected first (all aborted)."""
    try:
        return await unless_disconnected(request, generation.run_to_completion())
    finally:
        await generation.close()


async def unless_disconnected(request: Request, work: Coroutine) -> bool:
    """Run `work` unless the client disconnects first (then cancel it); True if it completed.

    The body is already read, so the next receive() returns only when the client goes away.
    """

    async def wait_for_disconnect() -> None:
        while (await request.receive())["type"] != "http.disconnect":
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
        return False
    work_task.result()
    return True


async def _cancel_and_wait(task: asyncio.Future) -> None:
    """Cancel `task` and wait until it has ended (asyncio.wait raises nothing of the task's)."""
    task.cancel()
    await asyncio.wait({task})
