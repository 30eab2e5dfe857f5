"""What evaluation harnesses and agent frameworks send: lm-eval's loglikelihood requests (echo
with logprobs, max_tokens 1 and 0) scored as transformers scores them in float32, vLLM's
prompt_logprobs, stop strings completed by the last allowed token, GET /v1/models/{id},
parallel_tool_calls, and forced or cut-off tool calls that never leak their raw text."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch

from firsttoken.server.server_config import ServerConfig
from tests.http_client import HTTP
from tests.server.conftest import MODEL_NAME, running_server
from tests.server.test_tools_api import ASK, TOOLS, _create

ORG_MODEL_NAME = "org/smollm2-135m"
TOLERANCE = 1e-3
LOGLIKELIHOOD_TEXT = "The capital of France is Paris, and the capital of Italy is Rome."


@pytest.fixture(scope="module")
def server(model_path):
    config = ServerConfig(port=0, served_model_names=(MODEL_NAME, ORG_MODEL_NAME))
    with running_server(model_path, config) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)


def _post(server, path: str, body: dict) -> httpx.Response:
    return HTTP.post(server.base_url + path, json={"model": MODEL_NAME, **body}, timeout=300)


def _prompt_ids(server, text: str) -> list[int]:
    return server.engine.tokenizer.encode(text)


# -- loglikelihood: echo with logprobs --------------------------------------------------------------


@pytest.mark.parametrize("max_tokens", [1, 0])
def test_lm_eval_loglikelihood_request_matches_transformers_float32(server, hf_model, max_tokens):
    token_ids = _prompt_ids(server, LOGLIKELIHOOD_TEXT)
    body = {"prompt": [token_ids], "max_tokens": max_tokens, "logprobs": 1, "echo": True, "temperature": 0}
    response = _post(server, "/v1/completions", body)
    assert response.status_code == 200, response.text
    reply = response.json()
    (choice,) = reply["choices"]
    logprobs = choice["logprobs"]
    num_shown = len(token_ids) + max_tokens
    assert len(logprobs["token_logprobs"]) == len(logprobs["tokens"]) == num_shown
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    with torch.no_grad():
        reference = torch.log_softmax(hf_model(torch.tensor([token_ids])).logits[0].float(), dim=-1)
    expected = [reference[position - 1, token_ids[position]].item() for position in range(1, len(token_ids))]
    assert logprobs["token_logprobs"][1 : len(token_ids)] == pytest.approx(expected, abs=TOLERANCE)
    for position in range(1, len(token_ids)):
        (top_value,) = logprobs["top_logprobs"][position].values()
        assert top_value == pytest.approx(reference[position - 1].max().item(), abs=TOLERANCE)
    prompt_text = server.engine.tokenizer.decode(token_ids)
    assert choice["text"].startswith(prompt_text)
    assert logprobs["text_offset"][: len(token_ids)][0] == 0
    if max_tokens == 0:
        assert choice["text"] == prompt_text and choice["finish_reason"] == "length"
        assert reply["usage"]["completion_tokens"] == 0
    else:
        assert logprobs["text_offset"][-1] == len(prompt_text)
        assert reply["usage"]["completion_tokens"] == 1


def test_echo_without_logprobs_repeats_the_text_prompt(server):
    body = {"prompt": "The capital of France is", "max_tokens": 3, "echo": True, "temperature": 0}
    echoed = _post(server, "/v1/completions", body).json()["choices"][0]
    plain = _post(server, "/v1/completions", {**body, "echo": False}).json()["choices"][0]
    assert echoed["logprobs"] is None
    assert echoed["text"] == "The capital of France is" + plain["text"]


def test_streamed_echo_sends_the_prompt_and_its_logprobs_first(server):
    body = {"prompt": LOGLIKELIHOOD_TEXT, "max_tokens": 2, "logprobs": 0, "echo": True, "temperature": 0}
    whole = _post(server, "/v1/completions", body).json()["choices"][0]
    text, token_logprobs = "", []
    url = server.base_url + "/v1/completions"
    with HTTP.stream("POST", url, json={**body, "stream": True}, timeout=300) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[len("data: ") :])["choices"][0]
                text += choice["text"]
                token_logprobs += choice["logprobs"]["token_logprobs"] if choice["logprobs"] else []
    assert text == whole["text"]
    assert token_logprobs == pytest.approx(whole["logprobs"]["token_logprobs"], abs=1e-6)


def test_max_tokens_zero_needs_echo(server):
    response = _post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 0})
    assert response.status_code == 400 and response.json()["error"]["param"] == "max_tokens"


@pytest.mark.parametrize("prompts", [1, 2])
def test_an_echo_with_no_room_for_its_hidden_token_speaks_of_what_was_sent(server, prompts):
    limit = server.engine.max_model_len
    full = [28] * limit
    prompt = full if prompts == 1 else [[28, 29], full]
    body = {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1}
    response = _post(server, "/v1/completions", body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == ("prompt" if prompts == 1 else "prompt[1]")
    assert f"{limit} prompt tokens" in error["message"] and f"at most {limit - 1}" in error["message"]
    assert "max_tokens (1)" not in error["message"] and str(limit + 1) not in error["message"]


# -- vLLM's prompt_logprobs ------------------------------------------------------------------------


def test_prompt_logprobs_on_completions_and_chat_in_vllm_shape(server):
    token_ids = _prompt_ids(server, LOGLIKELIHOOD_TEXT)
    body = {"prompt": [token_ids], "max_tokens": 1, "temperature": 0}
    echoed = _post(server, "/v1/completions", {**body, "echo": True, "logprobs": 0}).json()["choices"][0]
    choice = _post(server, "/v1/completions", {**body, "prompt_logprobs": 2}).json()["choices"][0]
    scores = choice["prompt_logprobs"]
    assert len(scores) == len(token_ids) and scores[0] is None
    for position, entry in enumerate(scores[1:], start=1):
        own = entry[str(token_ids[position])]
        assert own["logprob"] == pytest.approx(echoed["logprobs"]["token_logprobs"][position], abs=1e-6)
        assert own["rank"] >= 1 and isinstance(own["decoded_token"], str)
        # The token itself and the two likeliest, one entry each: two when it is one of them.
        assert len(entry) == (2 if own["rank"] <= 2 else 3)
        assert {1, 2} <= {value["rank"] for value in entry.values()}

    messages = [{"role": "user", "content": "Hi"}]
    chat_body = {"messages": messages, "max_tokens": 1, "prompt_logprobs": 0, "temperature": 0}
    chat = _post(server, "/v1/chat/completions", chat_body)
    assert chat.status_code == 200, chat.text
    reply = chat.json()
    assert len(reply["prompt_logprobs"]) == reply["usage"]["prompt_tokens"]
    assert reply["prompt_logprobs"][0] is None
    assert all(len(entry) == 1 for entry in reply["prompt_logprobs"][1:])


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_streamed_prompt_logprobs_are_refused(server, path):
    messages = [{"role": "user", "content": "Hi"}]
    body = {"prompt": "Hi"} if path == "/v1/completions" else {"messages": messages}
    response = _post(server, path, {**body, "prompt_logprobs": 1, "stream": True, "max_tokens": 2})
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt_logprobs"


# -- stop strings on the last allowed token --------------------------------------------------------


def _stop_string_ending_at_token(server, prompt: str) -> tuple[int, str, str]:
    """(k, s, text): greedy token k's own text, stripped (s), first appears where token k
    completes it; `text` is the output up to token k."""
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "logprobs": 0, "ignore_eos": True}
    tokens = _post(server, "/v1/completions", body).json()["choices"][0]["logprobs"]["tokens"]
    for index in range(2, len(tokens)):
        before, piece = "".join(tokens[:index]), tokens[index].strip()
        if piece and piece not in before + tokens[index][: -1]:
            return index, piece, before + tokens[index]
    raise AssertionError(f"no usable token in {tokens}")


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_completed_by_the_last_allowed_token_finishes_with_stop(server, client, stream):
    prompt = "The capital of France is"
    index, stop_string, text = _stop_string_ending_at_token(server, prompt)
    response = client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=index + 1, stop=[stop_string], temperature=0,
        stream=stream, extra_body={"ignore_eos": True},
    )
    if stream:
        chunks = [chunk.choices[0] for chunk in response if chunk.choices]
        output, finish_reason = "".join(c.text for c in chunks), chunks[-1].finish_reason
    else:
        output, finish_reason = response.choices[0].text, response.choices[0].finish_reason
    assert finish_reason == "stop"
    assert output == text[: text.rindex(stop_string)]


# -- GET /v1/models/{id} -----------------------------------------------------------------------------


def test_get_one_model_by_id_including_ids_with_a_slash(server, client):
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
    card = HTTP.get(server.base_url + "/v1/models/" + ORG_MODEL_NAME).json()
    assert (card["id"], card["object"]) == (ORG_MODEL_NAME, "model")
    missing = HTTP.get(server.base_url + "/v1/models/no-such-model")
    assert missing.status_code == 404
    error = missing.json()["error"]
    assert error["code"] == "model_not_found" and "no-such-model" in error["message"]


# -- tools ------------------------------------------------------------------------------------------

BOTH = [{"role": "user", "content": "What is the weather in Paris, and the time in Tokyo? Call both tools."}]


@pytest.mark.parametrize("stream", [False, True])
def test_required_without_parallel_tool_calls_gives_one_call(client, stream):
    content, calls, finish_reason = _create(
        client, stream, BOTH, tools=TOOLS, tool_choice="required", parallel_tool_calls=False
    )
    assert len(calls) == 1 and finish_reason == "tool_calls" and content is None


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_call_cut_off_by_max_tokens_shows_no_raw_text(client, stream):
    response = client.chat.completions.create(
        model=MODEL_NAME, messages=ASK, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=8,
        stream=stream,
    )
    if stream:
        chunks = [chunk.choices[0] for chunk in response if chunk.choices]
        content = "".join(chunk.delta.content or "" for chunk in chunks)
        calls = [call for chunk in chunks for call in chunk.delta.tool_calls or []]
        finish_reason = chunks[-1].finish_reason
    else:
        message = response.choices[0].message
        content, calls = message.content or "", message.tool_calls or []
        finish_reason = response.choices[0].finish_reason
    assert finish_reason == "length"
    assert "<tool_call>" not in content and "{" not in content and calls == []


@pytest.mark.parametrize("tools", [None, TOOLS])
def test_a_reply_without_calls_leaves_tool_calls_out_as_openai_does(server, tools):
    body = {"messages": ASK, "max_tokens": 3, "temperature": 0, **({"tools": tools} if tools else {})}
    whole = _post(server, "/v1/chat/completions", body)
    assert whole.status_code == 200 and "tool_calls" not in whole.json()["choices"][0]["message"]
    url = server.base_url + "/v1/chat/completions"
    streamed = {"model": MODEL_NAME, **body, "stream": True}
    with HTTP.stream("POST", url, json=streamed, timeout=300) as response:
        deltas = [
            json.loads(line[len("data: ") :])["choices"][0]["delta"]
            for line in response.iter_lines()
            if line.startswith("data: {")
        ]
    assert deltas and not any("tool_calls" in delta for delta in deltas)


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_call_whose_schema_leaves_additional_properties_open_ends(client, stream):
    open_weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 30}}}}}
    named = {"type": "function", "function": {"name": "get_weather"}}
    content, calls, finish_reason = _create(client, stream, ASK, tools=[open_weather], tool_choice=named)
    assert finish_reason == "tool_calls" and content is None
    (call,) = calls
    assert set(json.loads(call["arguments"])) <= {"city"}
