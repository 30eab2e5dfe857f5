"""Tools end to end with the `openai` client and the embedded model, streamed and whole: a
forced call (tool_choice "required" and a named function) comes back as OpenAI tool_calls whose
arguments follow the tool's schema, finish_reason "tool_calls"; the round trip call -> tool
message -> answer; tool_choice "none"; bad tool choices are 400s naming the field."""

from __future__ import annotations

import json

import jsonschema
import pytest

from firsttoken.server.server_config import ServerConfig
from tests.http_client import HTTP
from tests.server.conftest import MODEL_NAME, running_server

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The current time in a time zone",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 30}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def server(model_path):
    with running_server(model_path, ServerConfig(port=0, served_model_names=(MODEL_NAME,))) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _create(client, stream: bool, messages, **fields) -> tuple[str | None, list[dict], str]:
    """(content, tool calls as {id, name, arguments}, finish_reason) of one greedy completion,
    the streamed one assembled from its deltas as a client does."""
    response = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, stream=stream, temperature=0, max_tokens=80, **fields
    )
    if not stream:
        message = response.choices[0].message
        calls = [
            {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
            for c in message.tool_calls or []
        ]
        return message.content, calls, response.choices[0].finish_reason
    content, calls, finish_reason = "", {}, None
    for chunk in response:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for part in delta.tool_calls or []:
            call = calls.setdefault(part.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = part.id or call["id"]
            call["name"] += part.function.name or ""
            call["arguments"] += part.function.arguments or ""
        finish_reason = chunk.choices[0].finish_reason or finish_reason
    return content or None, [calls[index] for index in sorted(calls)], finish_reason


def _schema_of(name: str) -> dict:
    return next(tool["function"]["parameters"] for tool in TOOLS if tool["function"]["name"] == name)


@pytest.mark.parametrize("stream", [False, True])
def test_round_trip_with_a_required_call(client, stream):
    content, calls, finish_reason = _create(client, stream, ASK, tools=TOOLS, tool_choice="required")
    assert finish_reason == "tool_calls" and calls, (content, calls)
    for call in calls:
        assert call["id"] and call["name"] in ("get_weather", "get_time")
        jsonschema.validate(json.loads(call["arguments"]), _schema_of(call["name"]))
    call = calls[0]
    conversation = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call["id"],
                    "type": "function",
                    "function": {"name": call["name"], "arguments": call["arguments"]},
                }
            ],
        },
        {
            "role": "tool",
            "tool_call_id": call["id"],
            "content": json.dumps({"temperature": 21, "sky": "sunny"}),
        },
    ]
    answer, answer_calls, answer_finish = _create(
        client, stream, conversation, tools=TOOLS, tool_choice="none"
    )
    assert answer and not answer_calls and answer_finish in ("stop", "length")


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_function_is_called_once(client, stream):
    named = {"type": "function", "function": {"name": "get_time"}}
    content, calls, finish_reason = _create(client, stream, ASK, tools=TOOLS, tool_choice=named)
    assert finish_reason == "tool_calls" and content is None
    assert [call["name"] for call in calls] == ["get_time"]
    jsonschema.validate(json.loads(calls[0]["arguments"]), _schema_of("get_time"))


def test_auto_parses_what_the_model_writes(client):
    content, calls, finish_reason = _create(client, False, ASK, tools=TOOLS)
    if calls:
        assert finish_reason == "tool_calls"
    else:
        assert content and "<tool_call>" not in content and finish_reason in ("stop", "length")


@pytest.mark.parametrize(
    "fields,param",
    [
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
        ),
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ],
)
def test_bad_tool_fields_get_400_naming_the_field(server, fields, param):
    body = {"messages": ASK, "max_tokens": 4, **fields}
    response = HTTP.post(server.base_url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.text


def test_tools_on_completions_are_refused(server):
    body = {"prompt": "hi", "max_tokens": 4, "tools": TOOLS}
    response = HTTP.post(server.base_url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "tools"
