"""Bearer-token authentication of the /v1 routes and /tokenize, /detokenize: checked before the
body is read, compared in constant time."""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from firsttoken.server.errors import APIError

PROTECTED_PREFIX = "/v1"
# Outside /v1 (as vLLM serves them) but spending the server's work on a client's input.
PROTECTED_PATHS = ("/tokenize", "/detokenize")


class ApiKeyGate:
    """ASGI middleware: a protected request without `Authorization: Bearer <api_key>` gets a 401
    before any of its body is read or parsed, so an unauthenticated client costs only its headers."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.api_key = api_key.encode("utf-8")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and _is_protected(scope["path"]) and not self._authorized(scope):
            refusal = APIError(
                401,
                "Incorrect or missing API key",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
            await refusal.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        authorization = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
        scheme, _, credentials = authorization.partition(b" ")
        # compare_digest takes as long whatever the first differing byte, so timing leaks nothing.
        return scheme.lower() == b"bearer" and hmac.compare_digest(credentials.strip(), self.api_key)


def _is_protected(path: str) -> bool:
    return path == PROTECTED_PREFIX or path.startswith(PROTECTED_PREFIX + "/") or path in PROTECTED_PATHS
