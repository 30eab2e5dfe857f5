"""Running a response's choices to the end: as server-sent events, or collected whole.

Both stop generating when the client goes away: a stream's body is cancelled by the ASGI
server on disconnect; a non-streamed reply watches for the disconnect itself.
"""

from __future__ import annotations

import contextlib
from typing import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from firsttoken.server import sse
from firsttoken.server.errors import APIError, from_exception
from firsttoken.server.generation import (
    Choice,
    close_streams,
    merged_deltas,
    run_to_completion,
    server_timing,
    ttft_extension,
    unless_disconnected,
    usage,
)
from firsttoken.server.reply import Reply


async def respond(
    choices: list[Choice],
    reply: Reply,
    stream: bool,
    include_usage: bool,
    retry_after_s: int,
    request: Request,
) -> Response:
    """The started choices as server-sent events, or, run to their end, as one JSON body."""
    if stream:
        events = stream_events(choices, reply, include_usage, retry_after_s)
        return StreamingResponse(events, media_type=sse.MEDIA_TYPE, headers=sse.HEADERS)
    if not await collect(choices, request):
        return Response(status_code=499)  # client closed the request; nobody reads this
    failure = generation_failure(choices)
    if failure is not None:
        return failure.response()
    return Response(
        reply.whole(choices).model_dump_json(),
        media_type="application/json",
        headers={"Server-Timing": server_timing(choices)},
    )


async def stream_events(
    choices: list[Choice], reply: Reply, include_usage: bool, retry_after_s: int
) -> AsyncIterator[bytes]:
    """The SSE body: a chunk per delta with something to show, the usage chunk if asked, [DONE].

    The TTFT extension rides on the usage chunk, or without one on the last chunk.
    """
    try:
        async with contextlib.aclosing(merged_deltas(choices)) as deltas:
            async for choice, delta in deltas:
                is_last = all(c.output.finished for c in choices)
                extension = ttft_extension(choices) if is_last and not include_usage else None
                chunk = reply.chunk(choice, delta, extension)
                if chunk is not None:
                    choice.num_chunks_sent += 1
                    yield sse.model_event(chunk, include_usage)
        failure = generation_failure(choices)
        if failure is not None:  # its choice's chunk said finish_reason "error"; this says why
            yield sse.event(failure.body())
        elif include_usage:
            yield sse.model_event(reply.usage_chunk(usage(choices), ttft_extension(choices)), include_usage)
    except Exception as error:  # the engine stopped mid-stream: say so in-band, then end
        yield sse.event(from_exception(error, retry_after_s).body())
    finally:
        await close_streams([choice.stream for choice in choices])
    yield sse.DONE


def generation_failure(choices: list[Choice]) -> APIError | None:
    """The error of the first choice that ended with finish_reason "error" (it waited past
    max_queue_wait_s, or its output constraint failed mid-generation), or None."""
    for choice in choices:
        if choice.output.finish_reason != "error":
            continue
        message = f"choice {choice.index}: {choice.output.stop_reason}"
        # The engine's reason names what ended it first, as "field: why".
        if str(choice.output.stop_reason).startswith("max_queue_wait_s:"):
            return APIError(503, message, "server_error", code="queue_timeout")
        return APIError(400, message, code="generation_failed")
    return None


async def collect(choices: list[Choice], request: Request) -> bool:
    """Run every choice to its end; False if the client disconnected first (all aborted)."""
    try:
        return await unless_disconnected(request, run_to_completion(choices))
    finally:
        await close_streams([choice.stream for choice in choices])
