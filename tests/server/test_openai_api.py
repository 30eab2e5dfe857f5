"""The OpenAI-compatible server end to end, with the official `openai` client and raw HTTP."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from typing import Callable

import httpx
import pytest

from firsttoken import SamplingParams
from firsttoken.server.server_config import ServerConfig
from tests.http_client import HTTP
from tests.prompts import SHORT_PROMPTS
from tests.server.conftest import MODEL_NAME, running_server

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(model_path):
    with running_server(
        model_path, ServerConfig(port=0, served_model_names=(MODEL_NAME, "alias"))
    ) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _completion(client, **kwargs):
    return client.completions.create(
        model=MODEL_NAME, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True}, **kwargs
    )


# -- outputs equal the offline API --------------------------------------------------------------


def test_completion_equals_llm_generate(client, llm):
    (expected,) = llm.generate([SHORT_PROMPTS[0]], GREEDY)
    response = _completion(client, prompt=SHORT_PROMPTS[0])
    assert response.object == "text_completion"
    assert response.model == MODEL_NAME
    (choice,) = response.choices
    assert choice.text == expected.text
    assert choice.finish_reason == "length"
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert response.usage.completion_tokens == MAX_TOKENS
    assert response.usage.total_tokens == len(expected.prompt_token_ids) + MAX_TOKENS
    assert response.usage.prompt_tokens_details.cached_tokens >= 0


def test_streamed_completion_with_usage(client, llm):
    (expected,) = llm.generate([SHORT_PROMPTS[2]], GREEDY)
    chunks = list(
        _completion(client, prompt=SHORT_PROMPTS[2], stream=True, stream_options={"include_usage": True})
    )
    *content_chunks, usage_chunk = chunks
    assert content_chunks[0].choices[0].text, "no content-less chunk before the first token"
    assert "".join(chunk.choices[0].text for chunk in content_chunks) == expected.text
    assert [c.choices[0].finish_reason for c in content_chunks][-1] == "length"
    assert all(chunk.usage is None for chunk in content_chunks)
    assert usage_chunk.choices == []
    assert usage_chunk.usage.completion_tokens == MAX_TOKENS
    (timings,) = usage_chunk.firsttoken["choices"]
    assert timings["ttft_s"] > 0


def test_chat_equals_llm_chat(client, llm):
    expected = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    response = client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_completion_tokens=MAX_TOKENS, temperature=0
    )
    assert response.object == "chat.completion"
    (choice,) = response.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == expected.text
    assert choice.finish_reason == expected.finish_reason
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert response.usage.completion_tokens == len(expected.token_ids)


def test_streamed_chat_sends_role_with_the_first_content(client, llm):
    expected = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    stream = client.chat.completions.create(
        model="alias",
        messages=CHAT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    first = chunks[0].choices[0].delta
    assert first.role == "assistant" and first.content, "the role travels with the first content"
    assert all(chunk.choices[0].delta.role is None for chunk in chunks[1:-1])
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks[:-1]) == expected.text
    assert chunks[-2].choices[0].finish_reason == expected.finish_reason
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids)
    assert chunks[-1].firsttoken["choices"][0]["index"] == 0


def test_streamed_chat_without_usage_carries_the_extension_on_its_last_chunk(client):
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=4, stream=True))
    assert not hasattr(chunks[0], "firsttoken") or chunks[0].firsttoken is None
    assert chunks[-1].choices[0].finish_reason is not None
    assert chunks[-1].firsttoken["choices"][0]["ttft_s"] > 0
    assert "usage" not in chunks[0].model_fields_set


# -- TTFT accounting ------------------------------------------------------------------------------


def test_non_streamed_reply_has_server_timing_matching_the_extension(server):
    response = HTTP.post(
        server.base_url + "/v1/completions",
        json={"prompt": SHORT_PROMPTS[1], "max_tokens": 4, "temperature": 0},
        timeout=120,
    )
    assert response.status_code == 200
    (stages,) = response.json()["firsttoken"]["choices"]
    header = dict(
        (entry.split(";")[0].strip(), float(entry.split("dur=")[1]))
        for entry in response.headers["server-timing"].split(",")
    )
    assert list(header) == ["tokenize", "queue", "prefill", "first_token_handoff", "ttft"]
    for name, milliseconds in header.items():
        assert milliseconds == pytest.approx(stages[f"{name}_s"] * 1000, abs=1e-3)
    parts = stages["tokenize_s"] + stages["queue_s"] + stages["prefill_s"] + stages["first_token_handoff_s"]
    assert parts == pytest.approx(stages["ttft_s"])
    assert stages["num_cached_tokens"] == response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_server_timing_of_many_choices_stays_short(server):
    """64 prompts x n=2: the header holds the slowest of each stage, not a set per choice."""
    prompts = [f"Number {index}" for index in range(64)]
    response = HTTP.post(
        server.base_url + "/v1/completions", json={"prompt": prompts, "n": 2, "max_tokens": 1}, timeout=120
    )
    assert response.status_code == 200
    header = response.headers["server-timing"]
    assert len(header) < 600
    stages = response.json()["firsttoken"]["choices"]
    ttft_ms = float(header.split("ttft;dur=")[1].split(";")[0])
    assert ttft_ms == pytest.approx(max(stage["ttft_s"] for stage in stages) * 1000, abs=1e-3)


def test_too_many_choices_get_400_before_any_work(server):
    response = HTTP.post(
        server.base_url + "/v1/completions",
        json={"prompt": [f"Number {index}" for index in range(64)], "n": 16, "max_tokens": 1},
        timeout=60,
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "n"


def test_repeated_prompt_reports_cached_tokens(client):
    prompt = "A shared prefix that spans more than one block of sixteen tokens, so it can be cached. " * 2
    _completion(client, prompt=prompt)
    second = _completion(client, prompt=prompt)
    assert second.usage.prompt_tokens_details.cached_tokens >= 16
    assert (
        second.firsttoken["choices"][0]["num_cached_tokens"]
        == second.usage.prompt_tokens_details.cached_tokens
    )


# -- several choices, logprobs, stop --------------------------------------------------------------


def test_n_and_prompt_lists_give_independent_indexed_choices(client, llm):
    expected = [output.text for output in llm.generate(SHORT_PROMPTS[:2], GREEDY)]
    response = _completion(client, prompt=SHORT_PROMPTS[:2], n=2)
    assert [choice.index for choice in response.choices] == [0, 1, 2, 3]
    assert [choice.text for choice in response.choices] == [
        expected[0],
        expected[0],
        expected[1],
        expected[1],
    ]
    prompt_tokens = sum(len(llm.tokenizer.encode(prompt)) for prompt in SHORT_PROMPTS[:2])
    assert response.usage.prompt_tokens == prompt_tokens
    assert response.usage.completion_tokens == 4 * MAX_TOKENS


def test_seeded_choices_differ_and_repeat(client):
    def sample(seed: int, n: int = 2):
        return client.chat.completions.create(
            model=MODEL_NAME,
            messages=CHAT,
            max_tokens=8,
            temperature=1.0,
            seed=seed,
            n=n,
            extra_body={"ignore_eos": True},
        )

    first, again = sample(7), sample(7)
    texts = [choice.message.content for choice in first.choices]
    assert texts == [choice.message.content for choice in again.choices]
    assert texts[0] != texts[1]
    # A choice draws as no choice of a neighbouring seed does; the first as n=1 with its seed.
    assert sample(8, n=1).choices[0].message.content != texts[1]
    assert sample(7, n=1).choices[0].message.content == texts[0]


def test_chat_logprobs(client):
    response = client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_tokens=3, temperature=0, logprobs=True, top_logprobs=2
    )
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].token == entry.token  # greedy picks the most likely token
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert bytes(entry.bytes).decode() == entry.token
    assert "".join(entry.token for entry in content) == response.choices[0].message.content


def test_completion_logprobs_stream(client):
    chunks = list(_completion(client, prompt=SHORT_PROMPTS[0], logprobs=1, stream=True))
    tokens = [token for chunk in chunks for token in chunk.choices[0].logprobs.tokens]
    assert len(tokens) == MAX_TOKENS
    assert all(len(chunk.choices[0].logprobs.top_logprobs[0]) == 1 for chunk in chunks)
    assert all(lp <= 0 for chunk in chunks for lp in chunk.choices[0].logprobs.token_logprobs)
    offsets = [offset for chunk in chunks for offset in chunk.choices[0].logprobs.text_offset]
    text = "".join(chunk.choices[0].text for chunk in chunks)
    assert offsets[0] == len(SHORT_PROMPTS[0]), "OpenAI counts offsets from the prompt's start"
    assert [offset - offsets[0] for offset in offsets] == [
        len("".join(tokens[:index])) for index in range(len(tokens))
    ]
    assert len(text) == len("".join(tokens))


def test_stop_string(client, llm):
    prompt = "Count: one, two, three,"
    (full,) = llm.generate([prompt], GREEDY)
    stop_word = full.text.split()[2]
    response = _completion(client, prompt=prompt, stop=[stop_word])
    assert response.choices[0].finish_reason == "stop"
    assert response.choices[0].text == full.text[: full.text.index(stop_word)]


@pytest.mark.parametrize("extreme", [dict(temperature=1e-300), dict(temperature=1.0, top_p=5e-324)])
def test_extreme_sampling_values_act_greedy_and_keep_the_engine_alive(client, llm, extreme):
    (expected,) = llm.generate([SHORT_PROMPTS[5]], GREEDY)
    response = client.completions.create(
        model=MODEL_NAME,
        prompt=SHORT_PROMPTS[5],
        max_tokens=MAX_TOKENS,
        extra_body={"ignore_eos": True},
        **extreme,
    )
    assert response.choices[0].text == expected.text


# -- concurrency and cancellation -----------------------------------------------------------------


def test_32_concurrent_streams_get_their_own_outputs(server, llm):
    import openai

    start = server.engine.stats()
    prompts = [f"Item {index}: the number after {index} is" for index in range(32)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected = [output.text for output in llm.generate(prompts, params)]

    async def stream_one(client: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await client.completions.create(
            model=MODEL_NAME,
            prompt=prompt,
            max_tokens=6,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        return "".join([chunk.choices[0].text async for chunk in stream])

    async def run_all() -> list[str]:
        async with openai.AsyncOpenAI(
            base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=300
        ) as client:
            return await asyncio.gather(*(stream_one(client, prompt) for prompt in prompts))

    assert asyncio.run(run_all()) == expected
    server.wait_for_idle_kv(since=start)


# Tokens an aborted stream may still decode while the server notices its client has gone.
MAX_DECODES_AFTER_A_DISCONNECT = 100


def test_disconnect_mid_stream_frees_kv_long_before_the_reply_would_end(server):
    start = server.engine.stats()
    aborted_before = server.metric("firsttoken:request_success_total", finished_reason="abort")
    with httpx.Client(base_url=server.base_url, timeout=120) as http:
        body = {"prompt": "Tell me a long story.", "max_tokens": 400, "stream": True, "ignore_eos": True}
        with http.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line).startswith("data: {")
            assert server.metric("firsttoken:kv_cache_usage_perc") > 0
    idle = server.wait_for_idle_kv(since=start)
    # Counted in tokens, not seconds: the abort cut the 400-token reply short.
    assert idle.num_decode_tokens - start.num_decode_tokens < MAX_DECODES_AFTER_A_DISCONNECT
    assert server.metric("firsttoken:request_success_total", finished_reason="abort") == aborted_before + 1


def test_disconnect_before_the_first_token_aborts(server):
    aborted_before = server.metric("firsttoken:request_success_total", finished_reason="abort")
    first_tokens_before = server.metric("firsttoken:time_to_first_token_seconds_count")
    # About 1000 prompt tokens: four prefill chunks of 256, so the first token is steps away.
    body = json.dumps({"prompt": "Tell me a long story. " * 180, "max_tokens": 400, "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", int(server.base_url.rsplit(":", 1)[1]))) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        # Left once prefilling: a client gone before its request reached the engine leaves
        # nothing to abort (the request is dropped unsubmitted).
        _wait_until(lambda: server.engine.stats().num_running == 1, "the request was not scheduled")
    deadline = time.monotonic() + 30
    while server.metric("firsttoken:request_success_total", finished_reason="abort") == aborted_before:
        assert time.monotonic() < deadline, "the request was not aborted"
        time.sleep(0.02)
    assert server.metric("firsttoken:time_to_first_token_seconds_count") == first_tokens_before
    server.wait_for_idle_kv()


def _wait_until(condition: Callable[[], bool], failure: str) -> None:
    deadline = time.monotonic() + 30  # bounds a hang; no measure of speed
    while not condition():
        assert time.monotonic() < deadline, failure
        time.sleep(0.005)


def test_disconnect_during_a_non_streamed_request_aborts(server):
    start = server.engine.stats()
    aborted_before = server.metric("firsttoken:request_success_total", finished_reason="abort")
    with pytest.raises(httpx.TimeoutException):
        HTTP.post(
            server.base_url + "/v1/completions",
            json={"prompt": "Tell me a long story.", "max_tokens": 400, "ignore_eos": True},
            timeout=0.5,
        )
    deadline = time.monotonic() + 30
    while server.metric("firsttoken:request_success_total", finished_reason="abort") == aborted_before:
        assert time.monotonic() < deadline, "the request was not aborted"
        time.sleep(0.02)
    server.wait_for_idle_kv(since=start)


# -- bad input ---------------------------------------------------------------------------------------


# (path, body, the field the 400 must name: its param starts with it)
INVALID_REQUESTS = [
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": 2.5}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_k": 0}, "top_k"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 50}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "12"}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": 42}, "prompt"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": [[]]}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "stop": [1]}, "stop"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 100_000}, "max_tokens"),
    ("/v1/completions", {"prompt": "word " * 9000}, "prompt"),
    ("/v1/completions", {"prompt": "x" * 3_000_000}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "stop": ["s"] * 300}, "stop"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 3_000_000}]}, "messages"),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 2.5}, "presence_penalty"),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/completions", {}, "prompt"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages[0].content"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": -5}, "max_completion_tokens"),
]


@pytest.mark.parametrize("path,body,param", INVALID_REQUESTS)
def test_invalid_fields_get_400_naming_the_field(server, path, body, param):
    response = HTTP.post(server.base_url + path, json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] is not None and error["param"].startswith(param), error
    assert error["message"].startswith(error["param"]), error
    assert "pydantic" not in error["message"] and "errors.pydantic.dev" not in response.text


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/v1/completions", {"prompt": "hi", "max_tokens": 100_000}, "max_tokens"),
        ("/v1/completions", {"prompt": ["hi", ""]}, "prompt"),
        ("/v1/chat/completions", {"messages": CHAT, "tool_choice": "auto"}, "tool_choice"),
        ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
    ],
)
def test_typed_errors_give_exactly_their_field_as_param(server, path, body, param):
    """The server's checks and its request validators raise InvalidInputError, which names the field."""
    response = HTTP.post(server.base_url + path, json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert error["message"].startswith(f"{param}: "), error


@pytest.mark.parametrize(
    "content,headers",
    [
        (b'{"prompt": "hi", "max_tok', {"Content-Type": "application/json"}),  # truncated JSON
        (b"{not json}", {"Content-Type": "application/json"}),
        (b"[1, 2]", {"Content-Type": "application/json"}),
        (b"", {"Content-Type": "application/json"}),
        (b'{"prompt": "hi"}', {"Content-Type": "text/plain"}),
        (b'{"prompt": "hi"}', {}),
        (b"prompt=hi", {"Content-Type": "application/x-www-form-urlencoded"}),
    ],
)
def test_malformed_bodies_get_400(server, content, headers):
    response = HTTP.post(server.base_url + "/v1/completions", content=content, headers=headers, timeout=60)
    assert response.status_code == 400, response.text
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize(
    "path,content,param",
    [
        ("/v1/completions", rb'{"prompt": "hi \ud800", "max_tokens": 2}', "prompt"),
        ("/v1/completions", rb'{"prompt": ["hi", "\udfff"], "max_tokens": 2}', "prompt[1]"),
        ("/v1/completions", rb'{"prompt": "hi", "model": "\ud800"}', "model"),
        ("/v1/chat/completions", rb'{"messages": [{"role": "user", "content": "\ud800"}]}',
         "messages[0].content"),
        ("/v1/chat/completions",
         rb'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]}',
         "messages[0].content[0].text"),
    ],
)  # fmt: skip
def test_a_lone_surrogate_is_a_400_naming_its_field_and_the_connection_lives_on(server, path, content, param):
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        response = http.post(path, content=content, headers={"Content-Type": "application/json"})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param
        assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code == 200


def test_a_body_of_a_million_values_is_refused_before_it_is_parsed(server):
    body = b'{"prompt": [' + b",".join([b"[1]"] * 1_000_000) + b"]}"
    response = HTTP.post(
        server.base_url + "/v1/completions",
        content=body,
        headers={"Content-Type": "application/json"},
        timeout=60,
    )
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "body_too_complex"


def test_unknown_model_gets_404(client):
    import openai

    with pytest.raises(openai.NotFoundError) as raised:
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=1)
    assert raised.value.body["code"] == "model_not_found"
    assert raised.value.body["param"] == "model"


def test_unknown_route_and_method_answer_in_the_openai_shape(server):
    missing = HTTP.get(server.base_url + "/v1/nothing")
    assert missing.status_code == 404 and "error" in missing.json()
    wrong_method = HTTP.get(server.base_url + "/v1/completions")
    assert wrong_method.status_code == 405 and "error" in wrong_method.json()


def test_bad_input_leaves_no_kv_allocated(server):
    """Nothing stays allocated, not even the good prompt admitted beside one the engine refuses."""
    start = server.engine.stats()
    for path, body, _ in INVALID_REQUESTS:
        assert HTTP.post(server.base_url + path, json=body, timeout=60).status_code == 400
    good_and_bad_prompt = {"prompt": [[1, 2, 3], [-1]], "max_tokens": 4}
    refused = HTTP.post(server.base_url + "/v1/completions", json=good_and_bad_prompt, timeout=60)
    assert refused.status_code == 400, refused.text
    server.wait_for_idle_kv(since=start)


# -- the other endpoints and the socket ----------------------------------------------------------


def test_models_health_version(client, server):
    assert [model.id for model in client.models.list()] == [MODEL_NAME, "alias"]
    assert HTTP.get(server.base_url + "/health").status_code == 200
    assert httpx.head(server.base_url + "/health").status_code == 200
    assert HTTP.get(server.base_url + "/version").json()["version"]


def test_metrics_parse_and_count_ttft(server, client):
    before = server.metric("firsttoken:time_to_first_token_seconds_count")
    _completion(client, prompt=SHORT_PROMPTS[3])
    assert server.metric("firsttoken:time_to_first_token_seconds_count") == before + 1
    from prometheus_client.parser import text_string_to_metric_families

    families = {
        family.name: family
        for family in text_string_to_metric_families(HTTP.get(server.base_url + "/metrics").text)
    }
    for name in (
        "firsttoken:time_to_first_token_seconds",
        "firsttoken:inter_token_latency_seconds",
        "firsttoken:e2e_request_latency_seconds",
        "firsttoken:request_queue_time_seconds",
        "firsttoken:request_prefill_time_seconds",
    ):
        assert families[name].type == "histogram"
    for name in (
        "prefix_cache_queries",
        "prefix_cache_hits",
        "num_preemptions",
        "prompt_tokens",
        "generation_tokens",
        "request_success",
    ):
        assert families["firsttoken:" + name].type == "counter"
    for name in ("kv_cache_usage_perc", "num_requests_running", "num_requests_waiting"):
        assert families["firsttoken:" + name].type == "gauge"
    assert server.metric("firsttoken:request_success_total", finished_reason="length") >= 1
    assert server.metric("firsttoken:generation_tokens_total") >= MAX_TOKENS


def test_accepted_sockets_have_tcp_nodelay(server):
    with httpx.Client(base_url=server.base_url) as http:
        assert http.get("/health").status_code == 200  # keeps the connection open
        connections = list(server.server.server_state.connections)
        assert connections
        for protocol in connections:
            sock = protocol.transport.get_extra_info("socket")
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
