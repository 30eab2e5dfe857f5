"""Every hostile input gets a 4xx in OpenAI's error shape, and the connection that carried it
still serves the next request."""

from __future__ import annotations

import json

import pytest

from tests.reliability.conftest import MAX_MODEL_LEN, MAX_QUEUE
from tests.reliability.wire import WireConnection

JSON = {"Content-Type": "application/json"}
GOOD_REQUEST = json.dumps({"prompt": "Hello", "max_tokens": 1}).encode()
FOUR_MB = 4 * 1024 * 1024


def _body(value: object) -> bytes:
    return json.dumps(value).encode()


# (case, path, raw body, headers, expected status, the error's param or None when it names no field)
HOSTILE = [
    ("malformed JSON", "/v1/completions", b"{not json}", JSON, 400, None),
    ("truncated JSON", "/v1/completions", b'{"prompt": "hi", "max_tok', JSON, 400, None),
    ("NaN", "/v1/completions", b'{"prompt": "hi", "temperature": NaN}', JSON, 400, None),
    ("deep nesting", "/v1/completions", b"[" * 100_000 + b"]" * 100_000, JSON, 400, None),
    ("deep nesting in a field", "/v1/completions", b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}",
     JSON, 400, None),
    ("invalid UTF-8", "/v1/completions", b'{"prompt": "hi \xff\xfe"}', JSON, 400, None),
    ("not an object", "/v1/completions", b"[1, 2]", JSON, 400, None),
    ("empty body", "/v1/completions", b"", JSON, 400, None),
    ("wrong content type", "/v1/completions", GOOD_REQUEST, {"Content-Type": "text/plain"}, 400, None),
    ("lone surrogate in prompt", "/v1/completions", rb'{"prompt": "hi \ud800", "max_tokens": 2}', JSON,
     400, "prompt"),
    ("lone surrogate in a prompt list", "/v1/completions", rb'{"prompt": ["a", "\udc00"]}', JSON,
     400, "prompt[1]"),
    ("lone surrogate in chat content", "/v1/chat/completions",
     rb'{"messages": [{"role": "user", "content": "\ud800"}]}', JSON, 400, "messages[0].content"),
    ("lone surrogate in a content part", "/v1/chat/completions",
     rb'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]}', JSON,
     400, "messages[0].content[0].text"),
    ("lone surrogate in model", "/v1/completions", rb'{"prompt": "hi", "model": "\ud800"}', JSON,
     400, "model"),
    ("huge body", "/v1/completions", b'{"prompt": "' + b"x" * FOUR_MB + b'"}', JSON, 413, None),
    ("a million values", "/v1/completions", b'{"prompt": [' + b",".join([b"[1]"] * 1_000_000) + b"]}",
     JSON, 400, None),
    ("a prompt of 3 MB", "/v1/completions", _body({"prompt": "x" * 3_000_000}), JSON, 400, "prompt"),
    ("out-of-vocab token id", "/v1/completions", _body({"prompt": [10**9], "max_tokens": 1}), JSON,
     400, "prompt"),
    ("negative token id", "/v1/completions", _body({"prompt": [[1, 2], [-1]], "max_tokens": 1}), JSON,
     400, "prompt"),
    ("over-long prompt", "/v1/completions", _body({"prompt": [1000] * (MAX_MODEL_LEN + 1)}), JSON,
     400, "prompt"),
    ("over-long output", "/v1/completions", _body({"prompt": "hi", "max_tokens": MAX_MODEL_LEN}), JSON,
     400, "max_tokens"),
    ("huge integer", "/v1/completions", b'{"prompt": "hi", "max_tokens": 1' + b"0" * 40 + b"}", JSON,
     400, "max_tokens"),
    ("prompts x n over the bound", "/v1/completions", _body({"prompt": ["a"] * 64, "n": 16}), JSON,
     400, "n"),
    ("more choices than the queue", "/v1/completions", _body({"prompt": ["a"] * (MAX_QUEUE + 1)}), JSON,
     400, "n"),
    ("too many stop strings", "/v1/completions", _body({"prompt": "hi", "stop": ["x"] * 300_000}), JSON,
     400, None),
    ("unsupported field", "/v1/chat/completions",
     _body({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"}), JSON,
     400, "tool_choice"),
    ("out-of-vocab logit_bias", "/v1/completions",
     _body({"prompt": "hi", "logit_bias": {"999999999": 5}}), JSON, 400, "logit_bias"),
    ("a logit_bias over its bound", "/v1/completions",
     _body({"prompt": "hi", "logit_bias": {str(i): 1 for i in range(5000)}}), JSON, 400, "logit_bias"),
    ("too many bad words", "/v1/completions", _body({"prompt": "hi", "bad_words": ["x"] * 5000}), JSON,
     400, "bad_words"),
    ("out-of-vocab stop_token_ids", "/v1/completions",
     _body({"prompt": "hi", "stop_token_ids": [2**62]}), JSON, 400, "stop_token_ids"),
    ("out-of-vocab detokenize", "/detokenize", _body({"tokens": [10**12]}), JSON, 400, "tokens"),
    ("unknown route", "/v1/nothing", GOOD_REQUEST, JSON, 404, None),
]  # fmt: skip


@pytest.mark.parametrize(
    "path,body,headers,status,param", [case[1:] for case in HOSTILE], ids=[case[0] for case in HOSTILE]
)
def test_hostile_input_gets_a_4xx_and_the_connection_lives_on(server, path, body, headers, status, param):
    connection = WireConnection(server.base_url)
    try:
        response = connection.request("POST", path, body, headers)
        assert response.status == status, response.body[:500]
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert isinstance(error["message"], str) and error["message"]
        if param is not None:
            assert error["param"] == param, error
        if response.closes_connection:  # said so in the reply: the client knows to reconnect
            connection.close()
            connection = WireConnection(server.base_url)
        follow_up = connection.request("POST", "/v1/completions", GOOD_REQUEST, JSON)
        assert follow_up.status == 200, follow_up.body[:500]
        assert follow_up.json()["choices"][0]["finish_reason"] == "length"
    finally:
        connection.close()


def test_head_health_and_wrong_method_on_one_connection(server):
    connection = WireConnection(server.base_url)
    try:
        assert connection.request("HEAD", "/health").status == 200
        wrong_method = connection.request("GET", "/v1/completions")
        assert wrong_method.status == 405 and "error" in wrong_method.json()
        assert connection.request("GET", "/health").status == 200
    finally:
        connection.close()
