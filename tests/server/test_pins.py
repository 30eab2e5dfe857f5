"""/v1/pins: pinning a system prompt over HTTP, behind the API key; bad input is a 400 naming the field."""

from __future__ import annotations

import httpx
import pytest

from firsttoken.server.server_config import ServerConfig
from tests.http_client import HTTP
from tests.server.conftest import MODEL_NAME, running_server

API_KEY = "pins-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
# Long enough that its chat-template rendering fills at least one KV block.
SYSTEM_PROMPT = "You are a patient tutor who explains each step of a calculation and checks the result twice."


@pytest.fixture(scope="module")
def server(model_path):
    config = ServerConfig(port=0, served_model_names=(MODEL_NAME,), api_key=API_KEY)
    with running_server(model_path, config) as running:
        yield running


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [("POST", "/v1/pins", {"system_prompt": SYSTEM_PROMPT}), ("GET", "/v1/pins", None),
     ("DELETE", "/v1/pins/prefix-0123456789abcdef", None)],
)  # fmt: skip
@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}], ids=["no key", "wrong key"])
def test_pins_need_the_api_key(server, method, path, body, headers):
    response = httpx.request(method, server.base_url + path, json=body, headers=headers)
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"


def test_a_pinned_system_prompt_is_listed_reused_and_deleted(server):
    start = server.engine.stats()
    with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=60) as http:
        first = http.post("/v1/pins", json={"system_prompt": SYSTEM_PROMPT})
        assert first.status_code == 200
        pin = first.json()
        assert pin["object"] == "pin" and pin["id"].startswith("prefix-")
        assert pin["num_tokens"] >= 16 and pin["num_tokens"] % 16 == 0
        assert http.post("/v1/pins", json={"system_prompt": SYSTEM_PROMPT}).json() == pin
        assert http.get("/v1/pins").json() == {"object": "list", "data": [pin]}

        messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "2+2?"}]
        chat = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
        assert chat.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= pin["num_tokens"]

        deleted = http.delete(f"/v1/pins/{pin['id']}")
        assert deleted.json() == {"id": pin["id"], "object": "pin", "deleted": True}
        assert http.get("/v1/pins").json()["data"] == []
        again = http.delete(f"/v1/pins/{pin['id']}")
        assert again.status_code == 404
        assert again.json()["error"]["param"] == "pin_id"
    server.wait_for_idle_kv(since=start)


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({}, "system_prompt", "Field required"),
        ({"system_prompt": 5}, "system_prompt", "valid string"),
        ({"system_prompt": ""}, "system_prompt", "at least 1 character"),
        ({"system_prompt": "Hi"}, "system_prompt", "fewer than one KV block"),
        ({"system_prompt": SYSTEM_PROMPT, "ttl": 5}, "ttl", "Extra inputs"),
    ],
)
def test_bad_pin_requests_are_400_naming_the_field(server, body, param, message):
    response = HTTP.post(server.base_url + "/v1/pins", json=body, headers=AUTH)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param
    assert message in error["message"]
    assert error["message"].startswith(param + ":")


def test_pins_without_a_prompt_cache_are_409(server, monkeypatch):
    monkeypatch.setattr(type(server.engine), "can_pin", property(lambda engine: False))
    response = HTTP.post(server.base_url + "/v1/pins", json={"system_prompt": SYSTEM_PROMPT}, headers=AUTH)
    assert response.status_code == 409
    assert response.json()["error"]["code"] == "prompt_cache_disabled"
