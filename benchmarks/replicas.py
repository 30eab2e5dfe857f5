"""Replicas on Ray Serve: prefix-aware routing against Ray's default power-of-two router.

    python benchmarks/replicas.py [--replicas 2] [--prefix-len 1024] [--prompts-per-group 6]
                             [--request-rate 0.5] [--rounds 1] [--ray-address auto]

Both routers serve the shared-prefix dataset of `firsttoken bench serve` (4 distinct system
prompts of --prefix-len tokens, each followed by a short question, groups interleaved) at a fixed
Poisson rate, each on freshly started replicas (empty caches), taking turns round by round.
Each replica's KV cache holds about --cached-prefixes prefixes: fewer than the 4 in play, as in
any deployment with more system prompts than one replica's memory, so where a prefix's requests
go decides whether its KV is still there. Printed: TTFT P50/P99 (client side: send to the first
content chunk), the prefix cache's hit rate in tokens, and the router's hit ratio (requests
whose replica already held part of their prompt), per router, medians over the rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import sys

import httpx
import ray
from prometheus_client.parser import text_string_to_metric_families
from ray import serve

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import print_table, save_result  # noqa: E402

from firsttoken.bench.datasets import DatasetSpec, build_prompts  # noqa: E402
from firsttoken.bench.serve_client import LoadShape, ServeTarget, run_load  # noqa: E402
from firsttoken.bench.serve_stats import SLO, summarize_run  # noqa: E402
from firsttoken.deploy.deploy_config import ReplicasConfig  # noqa: E402
from firsttoken.deploy.ray import build_application  # noqa: E402
from firsttoken.models.registry import default_model_path, open_checkpoint  # noqa: E402
from firsttoken.server.server_config import ServerConfig  # noqa: E402

APP_NAME = "firsttoken-bench"
ROUTERS = ("pow2", "prefix")
# float32 KV of SmolLM2-135M: 30 layers x 2 (K, V) x 3 heads x 64 dims x 4 bytes per token.
KV_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 4


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def router_counts(base_url: str) -> tuple[float, float]:
    """(requests, prefix hits) the ingress counted so far, over every replica."""
    totals = {"firsttoken:router_requests": 0.0, "firsttoken:router_prefix_hits": 0.0}
    for family in text_string_to_metric_families(httpx.get(base_url + "/metrics").text):
        if family.name in totals:
            totals[family.name] = sum(
                sample.value for sample in family.samples if sample.name.endswith("_total")
            )
    return totals["firsttoken:router_requests"], totals["firsttoken:router_prefix_hits"]


def run_router(router: str, args: argparse.Namespace, base_url: str, prompts: list) -> dict[str, float]:
    """Deploy fresh replicas routed by `router`, send the load, delete the application."""
    engine_options = dict(
        dtype="float32",
        num_threads=args.threads_per_replica,
        chunk_size=512,
        kv_cache_memory_bytes=int(args.cached_prefixes * (args.prefix_len + 64) * KV_BYTES_PER_TOKEN),
    )
    replicas = ReplicasConfig(num_replicas=args.replicas, num_cpus=args.threads_per_replica, router=router)
    application = build_application(
        default_model_path(), engine_options, ServerConfig(served_model_names=("bench",)), replicas
    )
    serve.run(application, name=APP_NAME, route_prefix="/")
    try:
        requests_before, hits_before = router_counts(base_url)
        target = ServeTarget(base_url, model="bench", ignore_eos=True)
        shape = LoadShape(request_rate=args.request_rate, seed=args.seed)
        run = asyncio.run(run_load(target, shape, prompts, show_progress=False))
        requests_after, hits_after = router_counts(base_url)
    finally:
        serve.delete(APP_NAME)
    summary = summarize_run(run.records, run.duration_s, SLO())
    counters = run.server_counters
    return {
        "ttft_p50_ms": summary.ttft_ms.median,
        "ttft_p99_ms": summary.ttft_ms.p99,
        "prefix_cache_hit_rate": counters.prefix_cache_hit_rate if counters else float("nan"),
        "router_hit_ratio": (hits_after - hits_before) / max(requests_after - requests_before, 1),
        "failed": summary.num_failed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--threads-per-replica", type=int, default=1)
    parser.add_argument(
        "--prefix-len", type=int, default=1024, help="tokens of each of the 4 shared prefixes"
    )
    parser.add_argument("--prompts-per-group", type=int, default=6, help="requests per prefix")
    parser.add_argument("--output-len", type=int, default=8)
    parser.add_argument("--request-rate", type=float, default=0.5, help="requests per second (Poisson)")
    parser.add_argument(
        "--cached-prefixes", type=float, default=2.5, help="prefixes one replica's KV cache holds"
    )
    parser.add_argument("--rounds", type=int, default=1, help="turns of both routers (medians over them)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ray-address", default=None, help="a Ray cluster (default: a local instance)")
    args = parser.parse_args()

    ray.init(address=args.ray_address, include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    base_url = f"http://127.0.0.1:{port}"
    spec = DatasetSpec(
        name="shared-prefix",
        num_prefix_groups=4,
        prompts_per_group=args.prompts_per_group,
        prefix_len=args.prefix_len,
        input_len=32,
        output_len=args.output_len,
        seed=args.seed,
    )
    prompts = build_prompts(spec, open_checkpoint(default_model_path()).tokenizer)
    results: dict[str, list[dict[str, float]]] = {router: [] for router in ROUTERS}
    try:
        for round_index in range(args.rounds):
            order = ROUTERS if round_index % 2 == 0 else ROUTERS[::-1]
            for router in order:
                results[router].append(run_router(router, args, base_url, prompts))
                print(f"round {round_index}: {router}: {results[router][-1]}", flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()

    # Medians over the rounds; failures are the most any round had.
    medians = {
        router: {
            key: (max if key == "failed" else statistics.median)(run[key] for run in runs) for key in runs[0]
        }
        for router, runs in results.items()
    }
    print(
        f"\n{args.replicas} replicas x {args.threads_per_replica} thread(s), "
        f"4 prefixes x {args.prefix_len} tokens, "
        f"{len(prompts)} requests at {args.request_rate}/s, {args.rounds} round(s); medians over rounds"
    )
    rows = [
        [
            router,
            m["ttft_p50_ms"],
            m["ttft_p99_ms"],
            m["prefix_cache_hit_rate"],
            m["router_hit_ratio"],
            m["failed"],
        ]
        for router, m in medians.items()
    ]
    print_table(
        ["router", "TTFT P50 ms", "TTFT P99 ms", "prefix cache hit", "router hit ratio", "failed"], rows
    )
    ratio = medians["prefix"]["ttft_p50_ms"] / medians["pow2"]["ttft_p50_ms"]
    print(f"\nTTFT P50, prefix-aware / power-of-two: {ratio:.2f}x")
    path = save_result(
        "replicas", {"args": vars(args), "runs": results, "medians": medians, "p50_ratio": ratio}
    )
    print(f"saved {path}")


if __name__ == "__main__":
    main()
