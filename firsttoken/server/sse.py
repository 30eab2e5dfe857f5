"""Server-sent events: each chunk is one `data:` line of orjson, the stream ends with [DONE]."""

from __future__ import annotations

from typing import Any

import orjson
from pydantic import BaseModel

MEDIA_TYPE = "text/event-stream"
DONE = b"data: [DONE]\n\n"
# A comment line: SSE clients skip it, and a client's (or a proxy's) read timeout starts over.
KEEPALIVE = b": queued\n\n"
# Proxies (nginx) must pass each event on at once rather than buffer the response.
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


# Characters JSON may carry raw that Python's str.splitlines (so httpx's iter_lines) takes for
# line ends: a client reading lines that way would get a generated one's event in pieces.
# Escaped, the JSON means the same; their UTF-8 bytes occur nowhere else (UTF-8 self-synchronizes).
_LINE_BREAKING_CHARACTERS = {
    "\u0085".encode(): b"\\u0085",
    "\u2028".encode(): b"\\u2028",
    "\u2029".encode(): b"\\u2029",
}


def event(payload: dict[str, Any]) -> bytes:
    """One `data:` line: orjson escapes the ASCII control characters; the Unicode line breaks
    are escaped here."""
    data = orjson.dumps(payload)
    for raw, escaped in _LINE_BREAKING_CHARACTERS.items():
        data = data.replace(raw, escaped)
    return b"data: " + data + b"\n\n"


def model_event(chunk: BaseModel, include_usage: bool) -> bytes:
    """One chunk; `usage` appears (null until the last chunk) only when the client asked for it."""
    return event(chunk.model_dump(exclude=None if include_usage else {"usage"}))
