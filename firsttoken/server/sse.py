"""Server-sent events: each chunk is one `data:` line of orjson, the stream ends with [DONE]."""

from __future__ import annotations

from typing import Any

import orjson
from pydantic import BaseModel

MEDIA_TYPE = "text/event-stream"
DONE = b"data: [DONE]\n\n"
# Proxies (nginx) must pass each event on at once rather than buffer the response.
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def event(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def model_event(chunk: BaseModel, include_usage: bool) -> bytes:
    """One chunk; `usage` appears (null until the last chunk) only when the client asked for it."""
    return event(chunk.model_dump(exclude=None if include_usage else {"usage"}))
