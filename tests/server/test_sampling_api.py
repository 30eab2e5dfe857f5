"""The sampling fields and tokenizer endpoints end to end, with the `openai` client and raw HTTP:
every field reaches the engine (the server's output equals LLM.generate with the same
SamplingParams), each visibly changes what is generated, bad values and unimplemented fields
are 400s naming the field, unknown fields are named in a warning; /tokenize and /detokenize."""

from __future__ import annotations

import logging

import httpx
import pytest

from firsttoken import SamplingParams
from firsttoken.server.server_config import ServerConfig
from tests.http_client import HTTP
from tests.server.conftest import MODEL_NAME, running_server

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "Hello"


@pytest.fixture(scope="module")
def server(model_path):
    with running_server(model_path, ServerConfig(port=0, served_model_names=(MODEL_NAME,))) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _completion_text(client, stream: bool, **fields) -> str:
    """The text of one completion of PROMPT, streamed or whole; non-OpenAI fields go in the body."""
    openai_names = {
        "temperature",
        "seed",
        "max_tokens",
        "presence_penalty",
        "frequency_penalty",
        "logit_bias",
    }
    extra = {name: value for name, value in fields.items() if name not in openai_names}
    known = {name: value for name, value in fields.items() if name in openai_names}
    response = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, stream=stream, extra_body=extra, **known
    )
    if stream:
        return "".join(chunk.choices[0].text for chunk in response if chunk.choices)
    return response.choices[0].text


def _chat_text(client, stream: bool, **fields) -> str:
    response = client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, stream=stream, temperature=0, extra_body=fields
    )
    if stream:
        return "".join(chunk.choices[0].delta.content or "" for chunk in response if chunk.choices)
    return response.choices[0].message.content


# (request fields, the SamplingParams they must become); each changes the plain output
FIELDS = {
    "presence_penalty": dict(presence_penalty=1.5),
    "frequency_penalty": dict(frequency_penalty=1.0),
    "repetition_penalty": dict(repetition_penalty=1.3),
    "min_p": dict(min_p=0.2),
    "min_tokens": dict(min_tokens=20),
    "bad_words": dict(bad_words=["the", "a"]),
}


# Every field whole, and streamed for one: a stream carries any field's output alike (the other
# streamed cases are the slow tier's).
def _field_case(name: str, stream: bool):
    marks = [pytest.mark.slow] if stream and name != "min_tokens" else []
    return pytest.param(name, stream, id=f"{name}-{'streamed' if stream else 'whole'}", marks=marks)


FIELD_CASES = [_field_case(name, stream) for name in FIELDS for stream in (False, True)]


FIELD_CASE_BASE = dict(temperature=0.8, seed=7, max_tokens=24)  # this seed ends early: min_tokens shows


@pytest.fixture(scope="module")
def plain_field_case_text(llm) -> str:
    """PROMPT's output with FIELD_CASE_BASE and no other field: what each field must change."""
    (plain,) = llm.generate([PROMPT], SamplingParams(**FIELD_CASE_BASE))
    return plain.text


@pytest.mark.parametrize("name,stream", FIELD_CASES)
def test_each_field_reaches_the_engine_and_changes_the_output(
    client, llm, plain_field_case_text, name, stream
):
    base = FIELD_CASE_BASE
    fields = FIELDS[name]
    (expected,) = llm.generate([PROMPT], SamplingParams(**base, **fields))
    assert expected.text != plain_field_case_text, "the field must change the output to show anything"
    assert _completion_text(client, stream, **base, **fields) == expected.text


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_logit_bias_forces_a_token(client, llm, stream):
    token_id = llm.tokenizer.encode(" banana", add_special_tokens=False)[0]
    text = _completion_text(
        client, stream, temperature=1.0, seed=5, max_tokens=5, logit_bias={str(token_id): 100}
    )
    assert text == llm.tokenizer.decode([token_id] * 5)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_frequency_penalty_changes_a_seeded_output(client, stream):
    base = dict(temperature=0.8, seed=11, max_tokens=24)
    plain = _completion_text(client, stream, **base)
    penalized = _completion_text(client, stream, **base, frequency_penalty=1.5)
    assert penalized != plain
    assert _completion_text(client, stream, **base, frequency_penalty=1.5) == penalized


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_min_tokens_prevents_an_early_stop(client, stream):
    response = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, temperature=0, max_tokens=40)
    assert response.choices[0].finish_reason == "stop" and response.usage.completion_tokens < 12
    held = client.chat.completions.create(
        model=MODEL_NAME,
        messages=CHAT,
        temperature=0,
        max_tokens=40,
        extra_body={"min_tokens": 25},
        stream=stream,
        stream_options={"include_usage": True} if stream else None,
    )
    usage = list(held)[-1].usage if stream else held.usage
    assert usage.completion_tokens >= 25


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_bad_words_never_appear(client, stream):
    assert "Paris" in _chat_text(client, stream)
    assert "Paris" not in _chat_text(client, stream, bad_words=["Paris"])


def test_stop_token_ids_end_the_output(client, llm):
    plain = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=12))
    response = client.chat.completions.create(
        model=MODEL_NAME,
        messages=CHAT,
        temperature=0,
        max_tokens=12,
        extra_body={"stop_token_ids": [plain.token_ids[3]]},
    )
    assert response.choices[0].finish_reason == "stop"
    assert response.usage.completion_tokens == 4


# -- refusals ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields,param",
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"logit_bias": {"49152": 5}}, "logit_bias"),
        ({"logit_bias": {"abc": 5}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {str(index): 1 for index in range(1025)}}, "logit_bias"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": [10**6]}, "stop_token_ids"),
        ({"bad_words": [" "]}, "bad_words"),
        ({"bad_words": "Paris"}, "bad_words"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f g"}}]}, "tools"),
        ({"functions": [{"name": "f"}]}, "functions"),
    ],
)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_bad_values_and_unimplemented_fields_get_400_naming_the_field(server, path, fields, param):
    body = {"prompt": "hi"} if path == "/v1/completions" else {"messages": CHAT}
    response = HTTP.post(server.base_url + path, json={**body, "max_tokens": 4, **fields}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"].startswith(param) and error["message"].startswith(error["param"]), error


def test_neutral_values_of_unimplemented_fields_are_accepted(server):
    body = {
        "messages": CHAT,
        "max_tokens": 2,
        "tool_choice": "none",
        "tools": [],
        "response_format": {"type": "text"},
    }
    assert HTTP.post(server.base_url + "/v1/chat/completions", json=body, timeout=60).status_code == 200


def test_unknown_fields_are_answered_and_named_in_one_warning(server, caplog):
    body = {"prompt": "hi", "max_tokens": 2, "use_beam_search": True, "length_penalty": 1.0}
    with caplog.at_level(logging.WARNING, logger="firsttoken.server.request_checks"):
        assert HTTP.post(server.base_url + "/v1/completions", json=body, timeout=60).status_code == 200
    assert [record.getMessage() for record in caplog.records] == [
        "ignoring request fields the API does not define: 'use_beam_search', 'length_penalty'"
    ]


# -- /tokenize and /detokenize --------------------------------------------------------------------------


def test_tokenize_a_prompt(server, llm):
    response = HTTP.post(server.base_url + "/tokenize", json={"model": MODEL_NAME, "prompt": "Hello world"})
    assert response.status_code == 200
    expected = llm.tokenizer.encode("Hello world")
    assert response.json() == {
        "count": len(expected),
        "max_model_len": server.engine.max_model_len,
        "tokens": expected,
    }


def test_tokenize_messages_counts_what_chat_completions_bills(server, client):
    tokenized = HTTP.post(server.base_url + "/tokenize", json={"messages": CHAT}).json()
    reply = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=1)
    assert tokenized["count"] == reply.usage.prompt_tokens == len(tokenized["tokens"])
    without_prompt = HTTP.post(
        server.base_url + "/tokenize", json={"messages": CHAT, "add_generation_prompt": False}
    )
    assert without_prompt.json()["count"] < tokenized["count"]


def test_tokenize_can_return_token_strings(server, llm):
    body = {"prompt": "Hello world", "return_token_strs": True}
    token_strs = HTTP.post(server.base_url + "/tokenize", json=body).json()["token_strs"]
    assert token_strs == [
        llm.tokenizer.id_to_token(token_id) for token_id in llm.tokenizer.encode("Hello world")
    ]


def test_detokenize_reads_ids_back(server, llm):
    token_ids = llm.tokenizer.encode("The capital of France is Paris.")
    response = HTTP.post(server.base_url + "/detokenize", json={"model": MODEL_NAME, "tokens": token_ids})
    assert response.json() == {"prompt": "The capital of France is Paris."}


@pytest.mark.parametrize(
    "path,body,status,param",
    [
        ("/tokenize", {}, 400, "prompt"),
        ("/tokenize", {"prompt": "hi", "messages": CHAT}, 400, "prompt"),
        ("/tokenize", {"prompt": 5}, 400, "prompt"),
        ("/tokenize", {"messages": []}, 400, "messages"),
        ("/tokenize", {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
        ("/detokenize", {"tokens": [1, 49152]}, 400, "tokens"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
        ("/detokenize", {"tokens": "hi"}, 400, "tokens"),
    ],
)
def test_tokenizer_endpoints_refuse_bad_bodies_naming_the_field(server, path, body, status, param):
    response = HTTP.post(server.base_url + path, json=body)
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == param


def test_no_cors_headers_unless_origins_are_allowed(server):
    headers = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST"}
    preflight = httpx.options(server.base_url + "/v1/completions", headers=headers)
    assert "access-control-allow-origin" not in preflight.headers
    answer = HTTP.get(server.base_url + "/v1/models", headers={"Origin": "https://app.example"})
    assert "access-control-allow-origin" not in answer.headers
