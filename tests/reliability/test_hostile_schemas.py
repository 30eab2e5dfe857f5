"""Hostile output constraints and tools: schemas too deep to walk, schemas no output satisfies,
tools that clash, and a constraint that fails mid-generation. Each is a 400 naming the field
(or, once generation started, an error the client sees), and the connection lives on."""

from __future__ import annotations

import json

import pytest

from tests.http_client import HTTP
from tests.reliability.wire import WireConnection

JSON = {"Content-Type": "application/json"}
GOOD_REQUEST = json.dumps({"prompt": "Hello", "max_tokens": 1}).encode()
MESSAGES = [{"role": "user", "content": "Call a tool."}]
SELF_REFERENCE = {"$ref": "#"}
DEFS_LOOP = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}
MUTUAL_LOOP = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}
# Matches one string of a million "a"s: llguidance's lexer gives up on it once generation starts.
HUGE_PATTERN = {"type": "object", "properties": {"a": {"type": "string", "pattern": "^(a{1000}){1000}$"}},
                "required": ["a"]}  # fmt: skip


def _nested_arrays(depth: int) -> str:
    """A schema of arrays nested `depth` deep, as JSON text (json.dumps itself cannot write it)."""
    return '{"type": "array", "items": ' * depth + '{"type": "integer"}' + "}" * depth


def _tool(name: str, parameters: dict | str) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def _schema_format(schema: dict | str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


DEEP = _nested_arrays(1000)


def _with_deep_schema(template: dict) -> bytes:
    """The body `template` with its "DEEP" string replaced by the deep schema."""
    return json.dumps(template).replace('"DEEP"', DEEP).encode()


# (case, path, body, the error's param)
HOSTILE = [
    ("deep response_format schema", "/v1/completions",
     _with_deep_schema({"prompt": "hi", "response_format": _schema_format("DEEP")}),
     "response_format.json_schema.schema"),
    ("deep response_format schema, streamed", "/v1/completions",
     _with_deep_schema({"prompt": "hi", "stream": True, "response_format": _schema_format("DEEP")}),
     "response_format.json_schema.schema"),
    ("deep guided_json object", "/v1/completions", _with_deep_schema({"prompt": "hi", "guided_json": "DEEP"}),
     "guided_json"),
    ("deep guided_json text", "/v1/completions", json.dumps({"prompt": "hi", "guided_json": DEEP}),
     "guided_json"),
    ("deep tool parameters", "/v1/chat/completions",
     _with_deep_schema({"messages": MESSAGES, "tools": [_tool("f", "DEEP")]}),
     "tools[0].function.parameters"),
    ("self-referencing schema", "/v1/completions",
     {"prompt": "hi", "response_format": _schema_format(SELF_REFERENCE)},
     "response_format.json_schema.schema"),
    ("a $defs loop", "/v1/completions", {"prompt": "hi", "guided_json": DEFS_LOOP}, "guided_json"),
    ("a mutual $ref loop", "/v1/chat/completions",
     {"messages": MESSAGES, "response_format": _schema_format(MUTUAL_LOOP)},
     "response_format.json_schema.schema"),
    ("a forced call of a self-referencing tool", "/v1/chat/completions",
     {"messages": MESSAGES, "tools": [_tool("f", SELF_REFERENCE)], "tool_choice": "required"},
     "tools[0].function.parameters"),
    ("an invalid tool schema under auto", "/v1/chat/completions",
     {"messages": MESSAGES, "tools": [_tool("f", {"type": "nonsense"})], "tool_choice": "auto"},
     "tools[0].function.parameters"),
    ("duplicate tool names", "/v1/chat/completions",
     {"messages": MESSAGES, "tools": [_tool("f", {"type": "object"}), _tool("f", {"type": "object"})]},
     "tools[1].function.name"),
    ("a prompt of 3 MB to tokenize", "/tokenize", {"prompt": "x" * 3_000_000}, "prompt"),
]  # fmt: skip


@pytest.mark.parametrize("path,body,param", [case[1:] for case in HOSTILE], ids=[case[0] for case in HOSTILE])
def test_hostile_schema_gets_a_400_naming_the_field(server, path, body, param):
    connection = WireConnection(server.base_url)
    try:
        raw = (
            body
            if isinstance(body, bytes)
            else (body if isinstance(body, str) else json.dumps(body)).encode()
        )
        response = connection.request("POST", path, raw, JSON)
        assert response.status == 400, response.body[:500]
        assert response.json()["error"]["param"] == param, response.json()
        assert not response.closes_connection
        follow_up = connection.request("POST", "/v1/completions", GOOD_REQUEST, JSON)
        assert follow_up.status == 200, follow_up.body[:500]
    finally:
        connection.close()


def test_invalid_utf8_is_named_as_such(server):
    response = HTTP.post(
        server.base_url + "/v1/completions", content=b'{"prompt": "hi \xff\xfe"}', headers=JSON
    )
    assert response.status_code == 400
    assert "not valid UTF-8" in response.json()["error"]["message"]
    assert "surrogate" not in response.json()["error"]["message"]


def test_a_trailing_slash_is_not_redirected(server):
    response = HTTP.post(server.base_url + "/tokenize/", json={"prompt": "hi"})
    assert response.status_code == 404
    assert "error" in response.json()


FAILING_CALL = {"messages": MESSAGES, "tools": [_tool("f", HUGE_PATTERN)], "tool_choice": "required",
                "max_tokens": 16}  # fmt: skip


def test_a_constraint_failing_mid_generation_is_an_error_not_a_stop(server):
    start = server.engine.stats()
    response = HTTP.post(server.base_url + "/v1/chat/completions", json=FAILING_CALL, timeout=120)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "generation_failed"
    assert "tool_choice: the output constraint failed mid-generation" in error["message"]
    server.wait_for_idle_kv(timeout_s=10.0, since=start)


def test_a_streamed_constraint_failing_mid_generation_ends_with_an_error_event(server):
    body = {**FAILING_CALL, "stream": True}
    with HTTP.stream("POST", server.base_url + "/v1/chat/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "generation_failed"
    finish_reasons = [
        choice["finish_reason"] for event in events[:-2] for choice in json.loads(event)["choices"]
    ]
    assert finish_reasons[-1] == "error"
