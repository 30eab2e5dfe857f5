"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}`, never a raw traceback.

Every failure a client can cause maps to a 4xx with a message naming the field; a bug
still answers in this shape (500) rather than as an HTML page or a dropped connection.
"""

from __future__ import annotations

import logging
import re

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import Response

from firsttoken.engine import EngineDeadError, InvalidInputError, QueueFullError, SloUnattainableError

logger = logging.getLogger(__name__)

_NOT_AN_OBJECT = {"model_type", "model_attributes_type", "dict_type"}
_JSON_CONTENT_TYPE = re.compile(r"^application/([\w.+-]+\+)?json\s*(;|$)", re.IGNORECASE)


class APIError(Exception):
    """An error to send as-is: status, OpenAI type and code, the offending field."""

    def __init__(
        self,
        status_code: int,
        message: str,
        error_type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.error_type = error_type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {
            "error": {
                "message": _encodable(self.message),
                "type": self.error_type,
                "param": None if self.param is None else _encodable(self.param),
                "code": self.code,
            }
        }

    def response(self) -> Response:
        return Response(
            orjson.dumps(self.body()), self.status_code, headers=self.headers, media_type="application/json"
        )


def is_json_content_type(content_type: str) -> bool:
    """application/json or a +json type, with or without parameters (charset)."""
    return _JSON_CONTENT_TYPE.match(content_type) is not None


def _encodable(text: str) -> str:
    """`text` with any lone surrogate (which orjson, rightly, refuses to write) escaped: an error
    that echoes client input must still be sendable."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def bad_request(error: ValueError) -> APIError:
    """A 400 with the error's message; `param` is the field an InvalidInputError names."""
    param = error.field if isinstance(error, InvalidInputError) else None
    return APIError(400, str(error), param=param)


def queue_full(error: QueueFullError, retry_after_s: int) -> APIError:
    """429: the queue is full (retry after the server's setting) or the request's TTFT objective
    is out of reach (retry after the engine's estimate)."""
    if isinstance(error, SloUnattainableError):
        code, retry_after_s = "ttft_slo_unattainable", error.retry_after_s
    else:
        code = "queue_full"
    return APIError(
        429,
        f"{error}; retry later",
        "rate_limit_error",
        code=code,
        headers={"Retry-After": str(retry_after_s)},
    )


def engine_unavailable(error: EngineDeadError) -> APIError:
    return APIError(503, str(error), "server_error", code="engine_unavailable")


def from_exception(error: Exception, retry_after_s: int) -> APIError:
    """The client-facing error for what generation can raise."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, QueueFullError):
        return queue_full(error, retry_after_s)
    if isinstance(error, EngineDeadError):
        return engine_unavailable(error)
    if isinstance(error, ValueError):
        return bad_request(error)
    logger.exception("unexpected error", exc_info=error)
    return APIError(500, "internal error; see the server log", "server_error")


def validation_error(error: RequestValidationError) -> APIError:
    """The first pydantic error as "field: message" (no pydantic internals leak out)."""
    first = error.errors()[0]
    location = [part for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        return APIError(400, "body: malformed JSON", param=None, code="invalid_json")
    if not location and first.get("type") in _NOT_AN_OBJECT:
        return APIError(400, "body: must be a JSON object", code="invalid_body")
    raised = first.get("ctx", {}).get("error")
    if isinstance(raised, ValueError):  # our own validator's error: its message is for the client
        return bad_request(raised)
    param = _dotted(location) if location else None
    return APIError(400, f"{param or 'body'}: {first.get('msg', 'invalid value')}", param=param)


def _dotted(location: list) -> str:
    text = ""
    for part in location:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def install_error_handlers(app: FastAPI, retry_after_s: int) -> None:
    """Answer every error in the OpenAI shape."""

    async def on_api_error(_: Request, error: APIError) -> Response:
        return error.response()

    async def on_validation_error(request: Request, error: RequestValidationError) -> Response:
        content_type = request.headers.get("content-type", "")
        if not is_json_content_type(content_type):
            return APIError(
                400, "Content-Type: must be application/json", code="invalid_content_type"
            ).response()
        return validation_error(error).response()

    async def on_http_error(_: Request, error: HTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
        return APIError(
            error.status_code,
            str(error.detail),
            code=code.get(error.status_code),
            headers=dict(error.headers or {}),
        ).response()

    async def on_generation_error(_: Request, error: Exception) -> Response:
        return from_exception(error, retry_after_s).response()

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(HTTPException, on_http_error)
    for error_class in (ValueError, QueueFullError, EngineDeadError):
        app.add_exception_handler(error_class, on_generation_error)
    # A bug: answered in the same shape, and still raised so that uvicorn logs its traceback.
    app.add_exception_handler(Exception, on_generation_error)
