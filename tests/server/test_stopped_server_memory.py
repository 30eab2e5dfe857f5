"""A stopped test server leaves nothing of its engine behind: the server modules of one test
process would otherwise hold a GB of weights and KV cache each."""

from __future__ import annotations

import gc
import weakref


from firsttoken.server.server_config import ServerConfig
from tests.http_client import HTTP
from tests.server.conftest import MODEL_NAME, running_server


def test_a_stopped_servers_engine_is_freed(model_path):
    with running_server(model_path, ServerConfig(port=0, served_model_names=(MODEL_NAME,))) as running:
        reply = HTTP.post(
            running.base_url + "/v1/completions",
            json={"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2},
            timeout=300,
        )
        assert reply.status_code == 200
        core = weakref.ref(running.engine.core)
    del running
    gc.collect()
    assert core() is None
