"""The Ray Serve application end to end: a local Ray instance, two replicas (one thread and a
small KV cache each) of the 2-layer random-weight model of the embedded model's shapes and
tokenizer (what is checked is routing, pins and the API through Ray, not the model's words), the
official `openai` client against the ingress.

Ray starts once for the module; the replica-killing test runs last, since it replaces one.
"""

from __future__ import annotations

import json
import os

import random
import socket
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from firsttoken.server.server_config import ServerConfig
from tests.http_client import HTTP

MODEL_NAME = "smollm2"
ENGINE_OPTIONS = dict(
    dtype="float32", kv_cache_memory_bytes=48 << 20, chunk_size=256, max_model_len=512, num_threads=1
)
SYSTEM_PROMPT = "You are a patient tutor who explains each step of a calculation and checks the result twice."
# How long the replicas may take to settle: it bounds a hang, it measures nothing (busy machines are slow).
SETTLE_LIMIT_S = 60
WORDS = "river comet ledger valley mill pasture flood volume daughter astronomer spring height".split()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray instance for the module (Ray is imported here, not when tests are collected)."""
    ray = pytest.importorskip("ray")
    from firsttoken.deploy.deploy_command import PROXY_CHECK_ENVIRONMENT

    # The proxy's health checks as patient as `firsttoken serve --replicas` makes them: the
    # replicas load while the proxy starts, which on a busy machine makes it miss the default ones.
    patient = {name: value for name, value in PROXY_CHECK_ENVIRONMENT.items() if name not in os.environ}
    os.environ.update(patient)
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()
        for name in patient:
            del os.environ[name]


@pytest.fixture(scope="module")
def endpoint(ray_cluster, two_layer_model_path):
    from ray import serve

    from firsttoken.deploy.ray import ReplicasConfig, build_application

    # No serve.shutdown() after the module: it waits seconds for each replica to drain, and the
    # cluster's shutdown (ray_cluster) ends Serve's actors with the rest.
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    replicas = ReplicasConfig(num_replicas=2, num_cpus=1, routing_stats_period_s=0.5, sync_interval_s=0.5)
    config = ServerConfig(served_model_names=(MODEL_NAME,))
    serve.run(
        build_application(two_layer_model_path, ENGINE_OPTIONS, config, replicas),
        name="firsttoken",
        route_prefix="/",
    )
    return f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def client(endpoint):
    import openai

    return openai.OpenAI(base_url=endpoint + "/v1", api_key="unused", max_retries=0, timeout=120)


def metric_by_replica(endpoint: str, name: str) -> dict[str, float]:
    """One metric's value per replica label, from /metrics."""
    values = {}
    for family in text_string_to_metric_families(HTTP.get(endpoint + "/metrics").text):
        for sample in family.samples:
            if sample.name == name:
                values[sample.labels["replica"]] = sample.value
    return values


def counts_since(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {replica: value - before.get(replica, 0.0) for replica, value in after.items()}


def prefix_text(seed: int, num_words: int = 150) -> str:
    chooser = random.Random(seed)
    return " ".join(chooser.choice(WORDS) for _ in range(num_words))


def test_chat_completions_and_streaming_through_the_openai_client(client):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=8, temperature=0)
    assert chat.choices[0].message.content and chat.usage.completion_tokens == 8

    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=8, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert (
        "".join(chunk.choices[0].delta.content or "" for chunk in chunks) == chat.choices[0].message.content
    )

    completion = client.completions.create(model=MODEL_NAME, prompt="The capital of France is", max_tokens=6)
    assert completion.choices[0].text and completion.usage.prompt_tokens == 5
    assert [model.id for model in client.models.list().data] == [MODEL_NAME]


def test_engine_errors_keep_their_status_and_field(endpoint):
    response = HTTP.post(
        endpoint + "/v1/completions", json={"prompt": "Hi", "max_tokens": 10**6, "model": MODEL_NAME}
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "max_tokens"
    unknown = HTTP.post(endpoint + "/v1/completions", json={"prompt": "Hi", "model": "nope"})
    assert unknown.status_code == 404


def test_requests_sharing_a_prefix_go_to_the_replica_holding_it(client, endpoint):
    prefixes = [prefix_text(seed) for seed in range(4)]
    for prefix in prefixes:  # each prefix's first request lands somewhere and computes it
        client.completions.create(model=MODEL_NAME, prompt=prefix + " warm up", max_tokens=1)
    requests_before = metric_by_replica(endpoint, "firsttoken:router_requests_total")
    hits_before = metric_by_replica(endpoint, "firsttoken:router_prefix_hits_total")

    num_hits = 0
    for index in range(40):
        prompt = f"{prefixes[index % 4]} question {index}:"
        completion = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1)
        num_hits += completion.usage.prompt_tokens_details.cached_tokens >= 128

    requests = counts_since(requests_before, metric_by_replica(endpoint, "firsttoken:router_requests_total"))
    hits = counts_since(hits_before, metric_by_replica(endpoint, "firsttoken:router_prefix_hits_total"))
    assert sum(requests.values()) == 40
    assert sum(hits.values()) / 40 >= 0.9 and num_hits / 40 >= 0.9
    assert len([replica for replica, count in requests.items() if count > 0]) == 2, "4 prefixes, 2 replicas"


def test_random_prefixes_spread_over_both_replicas(client, endpoint):
    """A miss goes to the replica holding fewer prefix blocks. Earlier tests may have left one
    replica holding many more, so the misses first go to the other one until the two hold about
    as many; the cap (60 prompts of ~5 blocks each) bounds that catch-up, not the rule."""
    before = metric_by_replica(endpoint, "firsttoken:router_requests_total")
    routed: dict[str, float] = {}
    for num_sent, seed in enumerate(range(100, 160), start=1):
        client.completions.create(model=MODEL_NAME, prompt=prefix_text(seed, num_words=60), max_tokens=1)
        routed = counts_since(before, metric_by_replica(endpoint, "firsttoken:router_requests_total"))
        if len(routed) == 2 and min(routed.values()) >= 3:
            break
    assert sum(routed.values()) == num_sent
    assert len(routed) == 2 and min(routed.values()) >= 3, routed


def test_a_pinned_system_prompt_is_pinned_on_every_replica(endpoint):
    with httpx.Client(base_url=endpoint, timeout=60) as http:
        pin = http.post("/v1/pins", json={"system_prompt": SYSTEM_PROMPT}).json()
        assert pin["num_tokens"] >= 16
        assert http.get("/v1/pins").json()["data"] == [pin]
        pinned = metric_by_replica(endpoint, "firsttoken:num_pinned_tokens")
        deadline = time.monotonic() + SETTLE_LIMIT_S
        while sorted(pinned.values()) != [pin["num_tokens"]] * 2 and time.monotonic() < deadline:
            time.sleep(0.2)  # the ingress syncs every replica's stats every 0.5 s
            pinned = metric_by_replica(endpoint, "firsttoken:num_pinned_tokens")
        assert sorted(pinned.values()) == [pin["num_tokens"]] * 2

        assert http.delete(f"/v1/pins/{pin['id']}").status_code == 200
        assert http.delete(f"/v1/pins/{pin['id']}").status_code == 404
        too_short = http.post("/v1/pins", json={"system_prompt": "Hi"})
        assert too_short.status_code == 400 and too_short.json()["error"]["param"] == "system_prompt"


@pytest.mark.slow  # a disconnect frees the KV by default in tests/reliability (one server, no Ray)
def test_a_client_that_goes_away_frees_the_replicas_kv(endpoint):
    body = {
        "model": MODEL_NAME,
        "prompt": "Once upon a time",
        "max_tokens": 300,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.Client(base_url=endpoint, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: {")
    deadline = time.monotonic() + SETTLE_LIMIT_S
    while True:  # the ingress cancels the call, and the replica aborts the request
        running = metric_by_replica(endpoint, "firsttoken:num_requests_running")
        usage = metric_by_replica(endpoint, "firsttoken:kv_cache_usage_perc")
        if sum(running.values()) == 0 and sum(usage.values()) == 0:
            break
        assert time.monotonic() < deadline, f"still running {running}, KV in use {usage}"
        time.sleep(0.2)


def _engine_actors(ray) -> list[str]:
    return [
        actor["name"]
        for actor in ray.util.list_named_actors(all_namespaces=True)
        if actor["namespace"] == "serve" and "FirstTokenEngine" in actor["name"]
    ]


def _replica_serving_the_most(endpoint: str, num_requests: int) -> tuple[str, int]:
    """The replica label with the most running requests and their number, once the replicas'
    reports account for all `num_requests`."""
    deadline = time.monotonic() + SETTLE_LIMIT_S
    running = metric_by_replica(endpoint, "firsttoken:num_requests_running")
    while sum(running.values()) != num_requests:
        assert time.monotonic() < deadline, f"running by replica: {running}, expected {num_requests} in all"
        time.sleep(0.1)
        running = metric_by_replica(endpoint, "firsttoken:num_requests_running")
    replica = max(running, key=running.__getitem__)
    return replica, int(running[replica])


@pytest.mark.slow  # ~25 s: Ray restarts the replica and the test waits for it
def test_a_killed_replica_fails_its_requests_and_is_replaced(endpoint, ray_cluster):
    """Runs last: the replica serving a stream is killed mid-stream. Each of its requests ends with
    an error event, a request on the other replica completes, new requests succeed, and Ray starts
    a replacement. (The router balances load, but where it sent the two streams is read from the
    replicas' reports rather than assumed: its queue lengths may lag a replica that just started.)"""
    body = {"model": MODEL_NAME, "max_tokens": 400, "ignore_eos": True, "stream": True, "temperature": 0}
    with httpx.Client(base_url=endpoint, timeout=120) as http:
        streams = [
            http.stream("POST", "/v1/completions", json={**body, "prompt": f"Story {seed}:"})
            for seed in (1, 2)
        ]
        responses = [stream.__enter__() for stream in streams]
        lines = [response.iter_lines() for response in responses]
        for line_iterator in lines:
            assert next(line_iterator).startswith("data: {")
        victim_label, num_victim_requests = _replica_serving_the_most(endpoint, len(streams))
        (victim,) = [name for name in _engine_actors(ray_cluster) if name.split("#")[-1] == victim_label]
        ray_cluster.kill(ray_cluster.get_actor(victim, namespace="serve"), no_restart=True)
        endings = []
        for line_iterator in lines:
            events = [line for line in line_iterator if line.startswith("data: ")]
            assert events[-1] == "data: [DONE]"
            endings.append(events[-2])
        for stream in streams:
            stream.__exit__(None, None, None)
        errors = [ending for ending in endings if "error" in json.loads(ending.removeprefix("data: "))]
        assert len(errors) == num_victim_requests, endings
        assert all("engine_unavailable" in error and "engine replica" in error for error in errors)

        survivor = http.post(
            "/v1/completions", json={"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 2}
        )
        assert survivor.status_code == 200

        deadline = time.monotonic() + 120
        while not (len(_engine_actors(ray_cluster)) == 2 and victim not in _engine_actors(ray_cluster)):
            assert time.monotonic() < deadline, "no replacement replica"
            time.sleep(0.5)
        replicas = metric_by_replica(endpoint, "firsttoken:num_requests_running")
        while len(replicas) != 2 or victim.split("#")[-1] in replicas:
            assert time.monotonic() < deadline, f"the ingress does not see the replacement: {replicas}"
            time.sleep(0.5)
            replicas = metric_by_replica(endpoint, "firsttoken:num_requests_running")
        for seed in range(200, 206):
            reply = http.post(
                "/v1/completions",
                json={"model": MODEL_NAME, "prompt": prefix_text(seed, 40), "max_tokens": 1},
            )
            assert reply.status_code == 200
