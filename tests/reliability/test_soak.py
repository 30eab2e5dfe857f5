"""A mixed load, bounded in time and count: whole and streamed completions and chats, several
choices, clients that leave mid-stream, hostile bodies and health probes. No answer may be a
5xx, no 200 may be incomplete, and the engine ends idle."""

from __future__ import annotations

import json
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx
import pytest

NUM_WORKERS = 4
MAX_REQUESTS_PER_WORKER = 2000
JSON = {"Content-Type": "application/json"}
CHAT = [{"role": "user", "content": "Name a colour."}]


@dataclass
class SoakTally:
    """What the workers saw: answers by kind, and every failure worth a look."""

    outcomes: Counter = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, outcome: str, failure: str | None = None) -> None:
        with self.lock:
            self.outcomes[outcome] += 1
            if failure is not None:
                self.failures.append(failure)


def _check_whole(response: httpx.Response, tally: SoakTally) -> None:
    if response.status_code >= 500:
        tally.record("5xx", f"{response.status_code}: {response.text[:300]}")
    elif response.status_code == 200:
        choices = response.json()["choices"]
        complete = choices and all(choice["finish_reason"] in ("length", "stop") for choice in choices)
        tally.record("complete" if complete else "incomplete", None if complete else response.text[:300])
    else:
        tally.record(str(response.status_code))


def _event_payload(event: str) -> dict | None:
    try:
        payload = json.loads(event.removeprefix("data: "))
    except json.JSONDecodeError:
        return None
    return payload if isinstance(payload, dict) else None


def _check_stream(
    http: httpx.Client, path: str, body: dict, tally: SoakTally, leave_after: int | None
) -> None:
    with http.stream("POST", path, json={**body, "stream": True}) as response:
        if response.status_code != 200:
            tally.record("5xx" if response.status_code >= 500 else str(response.status_code))
            return
        events = []
        for line in response.iter_lines():
            if line:
                events.append(line)
            if leave_after is not None and len(events) >= leave_after:
                tally.record("left")
                return
    payloads = [_event_payload(event) for event in events[:-1]]
    if None in payloads:
        tally.record("incomplete", "\n".join(events))
        return
    finished = [
        payload
        for payload in payloads
        if any(choice.get("finish_reason") for choice in payload.get("choices", ()))
    ]
    # A sampled token may read "error"; only an error object in the event is a failure.
    errors = [payload for payload in payloads if "error" in payload]
    complete = bool(events) and events[-1] == "data: [DONE]" and bool(finished) and not errors
    tally.record("complete" if complete else "incomplete", None if complete else "\n".join(events))


def _one_request(http: httpx.Client, rng: random.Random, tally: SoakTally) -> None:
    kind = rng.randrange(8)
    completion = {"prompt": f"Count from {rng.randrange(100)}:", "max_tokens": rng.randint(1, 12)}
    if kind == 0:
        _check_whole(http.post("/v1/completions", json=completion), tally)
    elif kind == 1:
        _check_stream(http, "/v1/completions", completion, tally, leave_after=None)
    elif kind == 2:
        _check_whole(http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 6}), tally)
    elif kind == 3:
        chat = {"messages": CHAT, "max_tokens": 6}
        _check_stream(http, "/v1/chat/completions", chat, tally, leave_after=None)
    elif kind == 4:
        _check_whole(http.post("/v1/completions", json={**completion, "n": 2, "temperature": 1.0}), tally)
    elif kind == 5:
        long_story = {"prompt": "Tell a story:", "max_tokens": 60, "ignore_eos": True}
        _check_stream(http, "/v1/completions", long_story, tally, leave_after=rng.randint(1, 3))
    elif kind == 6:
        hostile = rng.choice([b"{not json", rb'{"prompt": "\ud800"}', b'{"prompt": [-1]}', b"[" * 3000])
        _check_whole(http.post("/v1/completions", content=hostile, headers=JSON), tally)
    else:
        response = http.head("/health")
        tally.record("5xx" if response.status_code >= 500 else "health")


def _soak(server, duration_s: float) -> SoakTally:
    tally = SoakTally()
    deadline = time.monotonic() + duration_s

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(base_url=server.base_url, timeout=60) as http:
            for _ in range(MAX_REQUESTS_PER_WORKER):
                if time.monotonic() > deadline:
                    return
                _one_request(http, rng, tally)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(NUM_WORKERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=duration_s + 120)
        assert not thread.is_alive(), "a soak worker hung"
    return tally


def _assert_clean(server, tally: SoakTally, start) -> None:
    failed = tally.outcomes["5xx"] + tally.outcomes["incomplete"]
    assert failed == 0, f"{tally.outcomes}; the first failures:\n" + "\n".join(tally.failures[:5])
    assert tally.outcomes["complete"] > 0, tally.outcomes
    server.wait_for_idle_kv(since=start)


def test_a_short_mixed_soak(server):
    start = server.engine.stats()
    _assert_clean(server, _soak(server, duration_s=4.0), start)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_minute_long_mixed_soak(server):
    start = server.engine.stats()
    _assert_clean(server, _soak(server, duration_s=60.0), start)
