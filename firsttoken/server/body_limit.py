"""A request body over the configured size gets an OpenAI-style 413 before it is parsed.

FastAPI's own `max_body_size` answers a body whose Content-Length is over the limit with
Starlette's plain-text 413, whatever the app's error handlers say, so the limit lives here.
"""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from firsttoken.server.errors import APIError


class BodySizeLimit:
    """ASGI middleware: refuses a body over `max_bytes`, at once when its Content-Length says
    so, otherwise as soon as the bytes read pass the limit (chunked uploads)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await APIError(413, self.message, code="request_too_large").response()(scope, receive, send)
            return
        num_received = 0

        async def receive_within_limit() -> Message:
            nonlocal num_received
            message = await receive()
            if message["type"] == "http.request":
                num_received += len(message.get("body", b""))
                if num_received > self.max_bytes:
                    # Raised inside the app's body parsing: its HTTPException handler answers.
                    raise HTTPException(413, self.message)
            return message

        await self.app(scope, receive_within_limit, send)

    @property
    def message(self) -> str:
        return f"body: larger than {self.max_bytes} bytes"
