"""JSON schemas of a request (response_format, guided_json, tool parameters) checked before
anything walks them recursively or generates under them: bounded in depth and size, compiled,
and able to match at least one output.

A schema nested ~1000 deep passes the body's own nesting limit yet overflows Python's
recursion in json.dumps; a self-referencing schema ({"$ref": "#"}) compiles but matches
nothing, so generating under it would end at once with an empty "stop". Both are the client's
to fix, so both are a 400 naming the field.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import llguidance
import orjson

from firsttoken.engine import InvalidInputError

MAX_SCHEMA_DEPTH = 64  # nested objects and arrays
MAX_SCHEMA_VALUES = 20_000  # every value of the schema, keys' values included


def checked_schema_text(schema: str | dict[str, Any], field: str) -> str:
    """The schema as JSON text, once its shape is within bounds and it can match something."""
    value = _parse(schema, field) if isinstance(schema, str) else schema
    if not isinstance(value, dict):
        raise InvalidInputError(field, f"must be a JSON object, got {type(value).__name__}")
    check_schema_shape(value, field)
    text = json.dumps(value)
    check_schema_matches_something(text, field)
    return text


def check_schema_shape(value: Any, field: str) -> None:
    """Refuse a schema nested deeper than MAX_SCHEMA_DEPTH or holding more than
    MAX_SCHEMA_VALUES values, walking it without recursion."""
    pending: list[tuple[Any, int]] = [(value, 1)]
    num_values = 0
    while pending:
        item, depth = pending.pop()
        num_values += 1
        if num_values > MAX_SCHEMA_VALUES:
            raise InvalidInputError(
                field, f"holds more than the {MAX_SCHEMA_VALUES} values a schema may hold"
            )
        if depth > MAX_SCHEMA_DEPTH:
            raise InvalidInputError(field, f"nests deeper than the {MAX_SCHEMA_DEPTH} levels a schema may")
        if isinstance(item, dict):
            pending.extend((child, depth + 1) for child in item.values())
        elif isinstance(item, list):
            pending.extend((child, depth + 1) for child in item)


def check_schema_matches_something(schema_text: str, field: str) -> None:
    """Compile the schema and compute what may come first: a schema no output can satisfy (a
    `$ref` loop) fails there, over a byte-level vocabulary in well under a millisecond."""
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema_text)
    except ValueError as error:
        raise InvalidInputError(field, _first_line(str(error))) from None
    matcher = llguidance.LLMatcher(_byte_vocabulary(), grammar, log_level=0)
    if not matcher.is_error():
        matcher.compute_bitmask()
    if matcher.is_error():
        raise InvalidInputError(
            field, f"no output can satisfy this schema ({_first_line(matcher.get_error())})"
        )


def _parse(text: str, field: str) -> Any:
    try:
        return orjson.loads(text)  # bounded nesting, unlike the standard library's recursion
    except orjson.JSONDecodeError as error:
        raise InvalidInputError(field, f"is not valid JSON ({error.msg})") from None


@functools.cache
def _byte_vocabulary() -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer("byte")


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else "invalid schema"
