"""JSON request bodies checked before FastAPI validates them: bounded in size of structure,
parsed off the event loop when large, and free of text that is not Unicode.

FastAPI reads a body with `await request.json()`, which would run the standard library's
parser on the event loop and let any error past it become a bare "error parsing the body".
The route class here reads and parses the body first; FastAPI's own `json()` call then gets
the checked value, and every refusal is an OpenAI-style 400 naming what is wrong.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Callable, Coroutine

import orjson
from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import Response

from firsttoken.engine import InvalidInputError
from firsttoken.server.server_config import JSONLimits
from firsttoken.server.errors import APIError, is_json_content_type


class CheckedJSONRequest(Request):
    """A request whose JSON body was parsed and checked before the endpoint's validation runs."""

    parsed_json: Any = None

    async def json(self) -> Any:
        return self.parsed_json


def checked_json_route(limits: JSONLimits) -> type[APIRoute]:
    """An APIRoute class whose endpoints get their JSON body parsed under `limits`."""

    class CheckedJSONRoute(APIRoute):
        """Parses and checks a JSON body before FastAPI's handler (and its validation) runs."""

        def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
            handler = super().get_route_handler()

            async def handle(request: Request) -> Response:
                checked = CheckedJSONRequest(request.scope, request.receive)
                if is_json_content_type(checked.headers.get("content-type", "")):
                    body = await checked.body()
                    if body:
                        checked.parsed_json = await parse_json_body(body, limits)
                return await handler(checked)

            return handle

    return CheckedJSONRoute


async def parse_json_body(body: bytes, limits: JSONLimits) -> Any:
    """The body's JSON value; a body too complex, malformed or holding a lone surrogate is a 400.

    A large body is parsed on a worker thread so that the event loop keeps answering
    (other requests, /health) while it is; a small one inline, where a thread hop costs more.
    """
    if len(body) <= limits.inline_parse_bytes:
        return _parse(body, limits)
    return await asyncio.to_thread(_parse, body, limits)


def _parse(body: bytes, limits: JSONLimits) -> Any:
    # Parsing cost grows with the number of values, not bytes (a million `[1]` takes seconds,
    # a 4 MB string milliseconds), and orjson holds the GIL throughout: count before parsing.
    if count_structural_bytes(body) > limits.max_values:
        num_values = count_json_values(body)
        if num_values > limits.max_values:
            raise APIError(
                400,
                f"body: holds {num_values} JSON values, more than the {limits.max_values} allowed",
                code="body_too_complex",
            )
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as error:
        raise _parse_error(body, error) from None


def count_structural_bytes(body: bytes) -> int:
    """Commas and opening brackets anywhere, strings included: at least the number of values
    but one, counted at C speed."""
    return body.count(b",") + body.count(b"[") + body.count(b"{")


def count_json_values(body: bytes) -> int:
    """How many values the JSON text holds, give or take one: commas and opening brackets
    outside strings. In valid JSON a backslash only appears inside a string, so once escaped
    backslashes and quotes are dropped, every quote left starts or ends a string."""
    unescaped = body.replace(b"\\\\", b"").replace(b'\\"', b"")
    return count_structural_bytes(b"".join(unescaped.split(b'"')[::2])) + 1


def _parse_error(body: bytes, error: orjson.JSONDecodeError) -> Exception:
    """The 400 for a body orjson refused: the field when the refusal is a lone surrogate escape
    (valid JSON syntax that no UTF-8 text can hold), bytes that are not UTF-8 (orjson calls
    both "surrogates not allowed"), otherwise malformed JSON."""
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as not_utf8:
        return APIError(400, f"body: not valid UTF-8 (byte {not_utf8.start})", code="invalid_json")
    if "surrogate" in error.msg:
        try:
            # The standard library accepts lone surrogates, which lets us say where one is.
            path = find_lone_surrogate(json.loads(body))
        except ValueError:
            path = None
        if path is not None:
            return InvalidInputError(path, "holds a lone UTF-16 surrogate escape, which is not valid Unicode")
    return APIError(400, f"body: malformed JSON ({error.msg} at byte {error.pos})", code="invalid_json")


def find_lone_surrogate(value: Any, path: str = "body") -> str | None:
    """The dotted path of the first string (or object key) in `value` that UTF-8 cannot encode."""
    pending: list[tuple[str, Any]] = [(path, value)]
    while pending:
        where, item = pending.pop()
        if isinstance(item, str):
            if not _is_encodable(item):
                return where
        elif isinstance(item, list):
            indexed = reversed(list(enumerate(item)))
            pending.extend((f"{where}[{index}]", element) for index, element in indexed)
        elif isinstance(item, dict):
            for key in reversed(list(item)):
                if not _is_encodable(key):
                    return where
                pending.append((key if where == "body" else f"{where}.{key}", item[key]))
    return None


def _is_encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
