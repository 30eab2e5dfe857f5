"""Bearer-token authentication of the /v1 routes, compared in constant time."""

from __future__ import annotations

import hmac
from typing import Awaitable, Callable

from fastapi import Depends
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from firsttoken.server.errors import APIError


def api_key_dependency(api_key: str) -> Callable[..., Awaitable[None]]:
    """A FastAPI dependency that lets a request through only with `Authorization: Bearer <api_key>`."""
    expected = api_key.encode("utf-8")
    bearer = HTTPBearer(auto_error=False, description="the server's --api-key")

    async def require_api_key(credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        presented = credentials.credentials.encode("utf-8") if credentials is not None else b""
        # compare_digest takes as long whatever the first differing byte, so timing leaks nothing.
        if not hmac.compare_digest(presented, expected):
            raise APIError(401, "Incorrect or missing API key", param=None, code="invalid_api_key")

    return require_api_key
