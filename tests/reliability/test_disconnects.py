"""A storm of clients that go away mid-prefill and mid-decode: every request is aborted and the
engine returns to idle, with every KV block free."""

from __future__ import annotations

import json
import socket
import threading
import time


from tests.http_client import HTTP
from tests.reliability.conftest import MAX_MODEL_LEN

NUM_PREFILL_LEAVERS = 8
NUM_DECODE_LEAVERS = 8
# About 200 prompt tokens: several prefill chunks of 32, so the first token is steps away.
LONG_PROMPT = "Tell me a long story about the sea. " * 22


def _leave_mid_prefill(base_url: str, delay_s: float) -> None:
    body = json.dumps({"prompt": LONG_PROMPT, "max_tokens": 40, "stream": True}).encode()
    host, port = base_url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        time.sleep(delay_s)


def _leave_mid_decode(base_url: str, num_chunks: int) -> None:
    body = {"prompt": "Count to a hundred:", "max_tokens": MAX_MODEL_LEN // 2, "stream": True,
            "ignore_eos": True}  # fmt: skip
    with HTTP.stream("POST", base_url + "/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        for _ in range(num_chunks):
            assert next(line for line in lines if line).startswith('data: {"id"')


def test_a_disconnect_storm_leaves_the_engine_idle(server):
    start = server.engine.stats()
    aborted_before = server.metric("firsttoken:request_success_total", finished_reason="abort")
    threads = [
        threading.Thread(target=_leave_mid_prefill, args=(server.base_url, 0.02 * index))
        for index in range(NUM_PREFILL_LEAVERS)
    ] + [
        threading.Thread(target=_leave_mid_decode, args=(server.base_url, 1 + index % 3))
        for index in range(NUM_DECODE_LEAVERS)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
        assert not thread.is_alive()
    server.wait_for_idle_kv(since=start)
    assert server.engine.stats().num_running == 0
    aborted_after = server.metric("firsttoken:request_success_total", finished_reason="abort")
    num_aborted = aborted_after - aborted_before
    # A client gone before its request was read leaves nothing to abort; the rest were running.
    assert NUM_DECODE_LEAVERS + NUM_PREFILL_LEAVERS // 2 <= num_aborted <= len(threads)
    after = HTTP.post(server.base_url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
    assert after.status_code == 200
