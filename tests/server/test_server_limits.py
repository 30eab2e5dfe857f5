"""A server with every limit set: API key, CORS origins, body size, queue, a short context; and a
fuzzer.

One request runs at a time (max_num_seqs=1) and one may wait (max_queue 1), so queue-full
answers are deterministic; the 48-token context keeps every fuzzed request short.
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator

import httpx
import pytest

from firsttoken.server.server_config import ServerConfig
from tests.http_client import HTTP
from tests.server.conftest import MODEL_NAME, RunningServer, running_server

API_KEY = "s3cret-key"
MAX_MODEL_LEN = 48
MAX_REQUEST_BYTES = 2048
AUTH = {"Authorization": f"Bearer {API_KEY}"}
ORIGIN = "https://app.example"


@contextlib.contextmanager
def _limited_server(model_path: str) -> Iterator[RunningServer]:
    config = ServerConfig(
        port=0,
        served_model_names=(MODEL_NAME,),
        api_key=API_KEY,
        max_request_bytes=MAX_REQUEST_BYTES,
        allowed_origins=(ORIGIN,),
    )
    with running_server(
        model_path, config, max_model_len=MAX_MODEL_LEN, max_num_seqs=1, max_waiting_requests=1
    ) as running:
        yield running


@pytest.fixture(scope="module")
def server(model_path):
    with _limited_server(model_path) as running:
        yield running


@pytest.fixture
def server_to_break(model_path):
    """A server of its own for a test that kills its engine: the module's server stays healthy."""
    with _limited_server(model_path) as running:
        yield running


def _post(server, body, headers=AUTH, **kwargs) -> httpx.Response:
    return HTTP.post(server.base_url + "/v1/completions", json=body, headers=headers, timeout=60, **kwargs)


# -- authentication ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": API_KEY},
        {"Authorization": "Bearer s3cret"},
        {"Authorization": "Basic czNjcmV0LWtleQ=="},
    ],
)
def test_missing_or_wrong_key_gets_401(server, headers):
    response = _post(server, {"prompt": "hi", "max_tokens": 1}, headers=headers)
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"
    assert response.headers["WWW-Authenticate"] == "Bearer"


@pytest.mark.parametrize(
    "content", [b"{not json", b"x" * (MAX_REQUEST_BYTES + 1), b"[" + b"[1]," * 400 + b"[1]]"]
)
def test_the_key_is_checked_before_the_body(server, content):
    """Malformed, oversized or costly bodies without the key are 401s: nothing was read."""
    response = HTTP.post(
        server.base_url + "/v1/completions", content=content, headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"


def test_the_right_key_is_accepted_by_the_openai_client(server):
    import openai

    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0)
    assert client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=2).choices[0].text
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base_url + "/v1", api_key="nope", max_retries=0).models.list()


def test_health_and_metrics_need_no_key(server):
    assert HTTP.get(server.base_url + "/health").status_code == 200
    assert httpx.head(server.base_url + "/health").status_code == 200
    assert HTTP.get(server.base_url + "/metrics").status_code == 200


@pytest.mark.parametrize("path,body", [("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})])
def test_the_tokenizer_endpoints_need_the_key(server, path, body):
    assert HTTP.post(server.base_url + path, json=body).status_code == 401
    assert HTTP.post(server.base_url + path, json=body, headers=AUTH).status_code == 200


# -- CORS -------------------------------------------------------------------------------------------


def test_a_preflight_from_an_allowed_origin_passes_without_the_key(server):
    headers = {
        "Origin": ORIGIN,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization",
    }
    response = httpx.options(server.base_url + "/v1/chat/completions", headers=headers)
    assert response.status_code == 200
    assert response.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in response.headers["access-control-allow-methods"]
    assert "authorization" in response.headers["access-control-allow-headers"].lower()


def test_answers_to_an_allowed_origin_carry_cors_headers_even_a_401(server):
    allowed = {"Origin": ORIGIN}
    assert (
        _post(server, {"prompt": "hi", "max_tokens": 1}, headers={**AUTH, **allowed}).headers[
            "access-control-allow-origin"
        ]
        == ORIGIN
    )
    refused = _post(server, {"prompt": "hi", "max_tokens": 1}, headers=allowed)
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == ORIGIN


def test_another_origin_gets_no_cors_headers(server):
    other = {"Origin": "https://elsewhere.example"}
    assert (
        "access-control-allow-origin"
        not in _post(server, {"prompt": "hi", "max_tokens": 1}, headers={**AUTH, **other}).headers
    )
    preflight = httpx.options(
        server.base_url + "/v1/completions", headers={**other, "Access-Control-Request-Method": "POST"}
    )
    assert preflight.status_code == 400 and "access-control-allow-origin" not in preflight.headers


# -- body size --------------------------------------------------------------------------------------


def test_body_over_the_limit_gets_413(server):
    body = {"prompt": "x" * MAX_REQUEST_BYTES}
    declared = _post(server, body)
    assert declared.status_code == 413
    assert declared.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: counted as it streams in
        yield b'{"prompt": "'
        for _ in range(4):
            yield b"x" * 1000
        yield b'"}'

    streamed = HTTP.post(
        server.base_url + "/v1/completions",
        content=chunks(),
        headers={**AUTH, "Content-Type": "application/json"},
    )
    assert streamed.status_code == 413
    assert streamed.json()["error"]["code"] == "request_too_large"


# -- context and queue ------------------------------------------------------------------------------


def test_missing_max_tokens_fills_the_rest_of_the_context(server):
    prompt = list(range(1000, 1040))
    response = _post(server, {"prompt": prompt, "ignore_eos": True})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == MAX_MODEL_LEN - len(prompt)
    assert response.json()["choices"][0]["finish_reason"] == "length"


def test_prompt_longer_than_the_context_gets_400(server):
    response = _post(server, {"prompt": list(range(1000, 1000 + MAX_MODEL_LEN + 1)), "max_tokens": 1})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "max_tokens"
    too_long_to_answer = _post(server, {"prompt": list(range(1000, 1000 + MAX_MODEL_LEN))})
    assert too_long_to_answer.status_code == 400
    assert too_long_to_answer.json()["error"]["param"] == "prompt"


def test_more_choices_than_the_queue_holds_get_400_and_keep_nothing(server):
    """Three choices, submitted together, could never fit one waiting place: a 400, not a 429
    the client would retry forever."""
    start = server.engine.stats()
    response = _post(server, {"prompt": "Once upon a time", "max_tokens": 20, "n": 3})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "n"
    assert _post(server, {"prompt": "Once upon a time", "max_tokens": 2}).status_code == 200
    server.wait_for_idle_kv(since=start)


def test_full_queue_gets_429_with_retry_after_and_keeps_nothing(server, monkeypatch):
    """One request running, one waiting: a third is refused with 429, and nothing of it stays."""
    start = server.engine.stats()
    step = server.engine.core.step

    def slow_step():  # the running request outlasts the test's requests, however fast the machine
        time.sleep(0.1)
        return step()

    monkeypatch.setattr(server.engine.core, "step", slow_step)
    long_stream = {"prompt": "Once upon a time", "max_tokens": 30, "stream": True, "ignore_eos": True}
    with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=long_stream) as running:
            lines = running.iter_lines()  # kept: a dropped line iterator closes the response
            assert next(line for line in lines if line).startswith('data: {"id"')
            with http.stream("POST", "/v1/completions", json=long_stream) as waiting:
                assert waiting.status_code == 200  # admitted: it holds the one waiting place
                response = _post(server, {"prompt": "Once upon a time", "max_tokens": 20})
    assert response.status_code == 429
    assert response.headers["Retry-After"] == "1"
    assert response.json()["error"]["code"] == "queue_full"
    server.wait_for_idle_kv(since=start)


# -- fuzzing the schema -------------------------------------------------------------------------------


def _fuzz(server, max_examples: int) -> None:
    """Positive and negative cases from /openapi.json: no answer may be a 5xx."""
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st
    from schemathesis.checks import not_a_server_error

    schema = schemathesis.openapi.from_url(server.base_url + "/openapi.json")
    cases = st.one_of(
        schema.as_strategy(schemathesis.GenerationMode.POSITIVE),
        schema.as_strategy(schemathesis.GenerationMode.NEGATIVE),
    )

    @settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=cases)
    def no_server_error(case: schemathesis.Case) -> None:
        case.call_and_validate(
            base_url=server.base_url, headers=AUTH, checks=[not_a_server_error], timeout=60
        )

    no_server_error()
    _unpin_all(server)  # a valid POST /v1/pins keeps its blocks by design
    server.wait_for_idle_kv()


def _unpin_all(server) -> None:
    for pin in HTTP.get(server.base_url + "/v1/pins", headers=AUTH).json()["data"]:
        assert HTTP.delete(f"{server.base_url}/v1/pins/{pin['id']}", headers=AUTH).status_code == 200


@pytest.mark.timeout(300)
def test_schemathesis_finds_no_server_error(server):
    _fuzz(server, max_examples=40)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_schemathesis_finds_no_server_error_long(server):
    _fuzz(server, max_examples=500)


# -- an engine failure, on a server of its own (its engine stays dead) -----------------------------


def test_engine_failure_ends_streams_in_band_and_health_turns_503(server_to_break, monkeypatch):
    def failing_step():
        raise RuntimeError("simulated device failure")

    monkeypatch.setattr(server_to_break.engine.core, "step", failing_step)
    body = {"prompt": "Hello", "max_tokens": 5, "stream": True}
    with HTTP.stream(
        "POST", server_to_break.base_url + "/v1/completions", json=body, headers=AUTH, timeout=60
    ) as response:
        assert response.status_code == 200
        events = [line for line in response.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert '"code":"engine_unavailable"' in events[-2]
    assert HTTP.get(server_to_break.base_url + "/health").status_code == 503
    refused = _post(server_to_break, {"prompt": "Hello", "max_tokens": 5})
    assert refused.status_code == 503
    assert refused.json()["error"]["type"] == "server_error"
