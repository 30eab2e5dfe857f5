"""The chat page's files over plain HTTP (public, on a server with an API key), and `--no-web-ui`."""

from __future__ import annotations

import asyncio
import re
from importlib import resources

import httpx
import pytest

from firsttoken.server.app import create_app
from firsttoken.server.server_config import ServerConfig
from tests.http_client import HTTP
from tests.server.conftest import MODEL_NAME, running_server

API_KEY = "page-test-key"
WEB_FOLDER = resources.files("firsttoken.server").joinpath("web")


@pytest.fixture(scope="module")
def server(model_path):
    config = ServerConfig(port=0, served_model_names=(MODEL_NAME,), api_key=API_KEY)
    with running_server(model_path, config) as running:
        yield running


def _web_files() -> dict[str, str]:
    return {entry.name: entry.read_text(encoding="utf-8") for entry in WEB_FOLDER.iterdir()}


def test_the_page_is_served_at_the_root_without_the_api_key(server):
    response = HTTP.get(server.base_url + "/")
    assert response.status_code == 200
    assert response.headers["content-type"] == "text/html; charset=utf-8"
    assert "script-src 'self'" in response.headers["content-security-policy"]
    assert response.headers["x-content-type-options"] == "nosniff"
    assert '<script type="module" src="/web/chat.js"></script>' in response.text


def test_every_file_the_page_loads_is_served_with_its_type(server):
    files = _web_files()
    referenced = set(re.findall(r'(?:src|href)="/web/([^"]+)"', files["index.html"]))
    for name, text in files.items():
        if name.endswith(".js"):
            referenced.update(re.findall(r'from "\./([^"]+)"', text))
    assert referenced == set(files) - {"index.html"}
    expected_types = {"js": "text/javascript", "css": "text/css"}
    for name in referenced:
        response = HTTP.get(f"{server.base_url}/web/{name}")
        assert response.status_code == 200, name
        assert response.headers["content-type"] == expected_types[name.rpartition(".")[2]] + "; charset=utf-8"
        assert response.text == files[name]


def test_the_page_fetches_nothing_from_elsewhere():
    for name, text in _web_files().items():
        assert not re.search(r"https?://|(?:src|href)=\"//|url\(|@import", text, re.IGNORECASE), name
        assert "innerHTML" not in text and "insertAdjacentHTML" not in text, name


def test_an_unknown_page_file_is_404(server):
    response = HTTP.get(server.base_url + "/web/missing.js")
    assert response.status_code == 404
    assert response.json()["error"]["param"] == "name"


def test_no_web_ui_answers_404_at_the_root(server):
    """The same engine behind an app made with web_ui=False (called in-process: nothing here
    reaches the engine)."""
    app = create_app(server.engine, ServerConfig(served_model_names=(MODEL_NAME,), web_ui=False))

    async def get(path: str) -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.get(path)

    for path in ("/", "/web/chat.js"):
        response = asyncio.run(get(path))
        assert response.status_code == 404, path
        assert response.json()["error"]["code"] == "not_found"
