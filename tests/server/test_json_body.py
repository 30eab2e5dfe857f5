"""Request bodies: counted before they are parsed, and a lone surrogate named by its field."""

from __future__ import annotations

import asyncio
import json

import pytest

from firsttoken.engine import InvalidInputError
from firsttoken.server.server_config import JSONLimits
from firsttoken.server.errors import APIError
from firsttoken.server.json_body import count_json_values, find_lone_surrogate, parse_json_body

LIMITS = JSONLimits(max_values=100, inline_parse_bytes=16)


def _parse(body: bytes):
    return asyncio.run(parse_json_body(body, LIMITS))


@pytest.mark.parametrize(
    "value",
    [
        {"prompt": "a, [b], {c}", "n": 2},
        {"prompt": [[1, 2], [3]], "stop": ['"', "\\", '\\",[']},
        [],
        "x",
    ],
)
def test_count_json_values_ignores_what_strings_hold(value):
    def count(item) -> int:
        if isinstance(item, list):
            return 1 + sum(count(element) for element in item)
        if isinstance(item, dict):
            return 1 + sum(count(element) for element in item.values())
        return 1

    assert count_json_values(json.dumps(value).encode()) in (count(value), count(value) + 1)


def test_bodies_parse_inline_and_on_a_thread_alike():
    assert _parse(b'{"a": 1}') == {"a": 1}
    assert _parse(b'{"prompt": "' + b"x" * 100 + b'"}') == {"prompt": "x" * 100}


def test_too_many_values_are_refused_before_parsing():
    with pytest.raises(APIError) as raised:
        _parse(b"[" + b",".join([b"[1]"] * 200) + b"]")
    assert (raised.value.status_code, raised.value.code) == (400, "body_too_complex")
    assert _parse(json.dumps({"prompt": "," * 500}).encode())["prompt"] == "," * 500


@pytest.mark.parametrize(
    "body,field",
    [
        (rb'{"prompt": "hi \ud800"}', "prompt"),
        (rb'{"prompt": ["ok", "\udc00"]}', "prompt[1]"),
        (rb'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud83d"}]}]}',
         "messages[0].content[0].text"),
        (rb'{"model": "\ud800"}', "model"),
        (rb'{"\ud800": 1}', "body"),
    ],
)  # fmt: skip
def test_a_lone_surrogate_names_its_field(body, field):
    with pytest.raises(InvalidInputError) as raised:
        _parse(body)
    assert raised.value.field == field


def test_a_surrogate_encoded_as_utf8_bytes_is_invalid_utf8():
    """Such bytes are no UTF-8 at all: the body is refused as such, naming the byte."""
    with pytest.raises(APIError, match="not valid UTF-8"):
        _parse(b'{"prompt": "\xed\xa0\x80"}')


def test_a_surrogate_pair_is_text():
    assert _parse(rb'{"prompt": "\ud83d\ude00"}') == {"prompt": "\N{GRINNING FACE}"}


@pytest.mark.parametrize("body", [b'{"prompt": "\xff"}', b"[" * 2000, b"[" * 50, b"{"])
def test_malformed_bodies_are_400_without_a_field(body):
    with pytest.raises(APIError) as raised:
        asyncio.run(parse_json_body(body, JSONLimits(max_values=10_000)))
    assert (raised.value.status_code, raised.value.code) == (400, "invalid_json")


def test_find_lone_surrogate_returns_none_for_clean_values():
    assert find_lone_surrogate({"a": ["b", {"c": "d"}]}) is None


def test_an_error_echoing_a_surrogate_is_still_sendable():
    error = APIError(404, "The model `\ud800` does not exist", param="model")
    assert b"\\\\ud800" in error.response().body
