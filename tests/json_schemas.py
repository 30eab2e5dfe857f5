"""Seeded random JSON schemas for structured-output tests: objects whose properties are strings,
integers, numbers, booleans, enums, arrays and nested objects, with required lists. Lengths and
counts are bounded (maxLength, maxItems, integer ranges), so a small model's output fits a few
dozen tokens."""

from __future__ import annotations

import random
from typing import Any

_NAMES = [
    "name", "city", "age", "count", "price", "active", "tags", "color", "address", "owner", "size",
    "score", "items", "status", "title", "level", "email", "rating", "notes", "id",
]
_WORDS = ["red", "green", "blue", "small", "large", "open", "closed", "north", "south"]
_SCALARS = ["string", "integer", "number", "boolean", "enum"]


def random_schema(seed: int, max_depth: int = 2) -> dict[str, Any]:
    """An object schema drawn from `seed` alone."""
    return _object(random.Random(seed), max_depth)


def _object(rng: random.Random, depth: int) -> dict[str, Any]:
    names = rng.sample(_NAMES, rng.randint(1, 3))
    properties = {name: _property(rng, depth) for name in names}
    required = [name for name in names if rng.random() < 0.7]
    # No other keys: a small model given free rein over keys can ramble until max_tokens.
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


def _property(rng: random.Random, depth: int) -> dict[str, Any]:
    kinds = _SCALARS + (["array", "object"] if depth > 1 else [])
    kind = rng.choice(kinds)
    if kind == "array":
        return {"type": "array", "items": _scalar(rng, rng.choice(_SCALARS)), "maxItems": rng.randint(1, 3)}
    if kind == "object":
        return _object(rng, depth - 1)
    return _scalar(rng, kind)


def _scalar(rng: random.Random, kind: str) -> dict[str, Any]:
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(3, 12)}
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(1, 500)}
    if kind == "number":
        return {"type": "number", "minimum": -1000, "maximum": 1000}
    if kind == "boolean":
        return {"type": "boolean"}
    return {"enum": rng.sample(_WORDS, rng.randint(2, 4))}


def example_instance(schema: dict[str, Any], seed: int) -> Any:
    """A value that validates against one of these schemas (shown to the model as an example)."""
    return _example(schema, random.Random(seed))


def _example(schema: dict[str, Any], rng: random.Random) -> Any:
    if "enum" in schema:
        return rng.choice(schema["enum"])
    kind = schema["type"]
    if kind == "object":
        return {name: _example(value, rng) for name, value in schema["properties"].items()}
    if kind == "array":
        return [_example(schema["items"], rng) for _ in range(rng.randint(1, schema["maxItems"]))]
    if kind == "string":
        return rng.choice(_WORDS)[: schema["maxLength"]]
    if kind == "integer":
        return rng.randint(schema["minimum"], schema["maximum"])
    if kind == "number":
        return round(rng.uniform(schema["minimum"], schema["maximum"]), 1)
    return rng.random() < 0.5
