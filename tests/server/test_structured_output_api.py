"""Structured output end to end with the `openai` client, streamed and whole: response_format
(json_object, json_schema) on chat and completions, vLLM's guided_json, guided_regex,
guided_choice and guided_grammar; outputs parse and validate; bad constraints are 400s naming
their field, and leave no request behind."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from firsttoken.server.server_config import ServerConfig
from tests.http_client import HTTP
from tests.server.conftest import MODEL_NAME, running_server

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
ASK_PERSON = [{"role": "user", "content": 'Describe a person as JSON, like {"name": "Ann", "age": 30}.'}]


@pytest.fixture(scope="module")
def server(model_path):
    with running_server(model_path, ServerConfig(port=0, served_model_names=(MODEL_NAME,))) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _chat(client, stream: bool, messages=ASK_PERSON, **fields) -> tuple[str, str]:
    """(content, finish_reason) of one greedy chat completion."""
    response = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, stream=stream, temperature=0, max_tokens=60, **fields
    )
    if not stream:
        return response.choices[0].message.content, response.choices[0].finish_reason
    chunks = [chunk for chunk in response if chunk.choices]
    return "".join(chunk.choices[0].delta.content or "" for chunk in chunks), chunks[-1].choices[
        0
    ].finish_reason


def _completion(client, stream: bool, prompt: str, **extra) -> tuple[str, str]:
    response = client.completions.create(
        model=MODEL_NAME, prompt=prompt, stream=stream, temperature=0, max_tokens=40, extra_body=extra
    )
    if not stream:
        return response.choices[0].text, response.choices[0].finish_reason
    chunks = [chunk for chunk in response if chunk.choices]
    return "".join(chunk.choices[0].text for chunk in chunks), chunks[-1].choices[0].finish_reason


@pytest.mark.parametrize("stream", [False, True])
def test_chat_json_schema(client, stream):
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": PERSON, "strict": True},
    }
    content, finish_reason = _chat(client, stream, response_format=response_format)
    assert finish_reason == "stop"
    jsonschema.validate(json.loads(content), PERSON)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_json_object(client, stream):
    content, finish_reason = _chat(client, stream, response_format={"type": "json_object"})
    assert content.startswith("{")
    if finish_reason == "stop":
        assert isinstance(json.loads(content), dict)


@pytest.mark.parametrize("stream", [False, True])
def test_completions_guided_fields(client, stream):
    text, reason = _completion(client, stream, "A person as JSON:", guided_json=PERSON)
    assert reason == "stop"
    jsonschema.validate(json.loads(text), PERSON)
    text, reason = _completion(
        client, stream, "Today's date:", guided_regex=r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"
    )
    assert reason == "stop" and re.fullmatch(r"20[0-9]{2}-[01][0-9]-[0-3][0-9]", text)
    text, reason = _completion(client, stream, "Is water wet? Answer:", guided_choice=["yes", "no"])
    assert reason == "stop" and text in ("yes", "no")
    text, reason = _completion(client, stream, "2 + 2 =", guided_grammar='root ::= " " [0-9] [0-9]?')
    assert reason == "stop" and re.fullmatch(r" [0-9][0-9]?", text)
    text, reason = _completion(
        client,
        stream,
        "Person:",
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
    )
    jsonschema.validate(json.loads(text), PERSON)


@pytest.mark.parametrize(
    "fields,param",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
         "response_format.json_schema.schema"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_regex": "(a"}, "guided_regex"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_grammar": "root ::= undefined"}, "guided_grammar"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ],
)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_bad_constraints_get_400_naming_the_field(server, path, fields, param):
    body = {"prompt": "hi"} if path == "/v1/completions" else {"messages": ASK_PERSON}
    response = HTTP.post(server.base_url + path, json={**body, "max_tokens": 4, **fields}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert error["message"].startswith(param), error
    server.wait_for_idle_kv()
