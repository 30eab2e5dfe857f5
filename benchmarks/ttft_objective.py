"""TTFT objective benchmark: goodput at saturation and past it, with and without the objective.

    python benchmarks/ttft_objective.py --rate 0.3 --ttft-slo-ms 2500 [--overload 1.5] [--num-prompts 40]

Each configuration is a `firsttoken serve` process loaded by the serving benchmark's client with
random 512-token prompts and 64 output tokens (--input-len, --output-len); the overloaded runs
send the same prompts at the same times, each to a fresh server. Runs: the defaults at --rate
(saturation: find it with `firsttoken tune` or `bench serve`), then at --overload times that rate
the defaults, --ttft-slo-ms with the best-effort policy, and with the refuse policy. Printed per
run: goodput (requests per second whose TTFT met the objective), SLO attainment of the requests
served, refusals, TTFT P50/P99; and each overloaded run's goodput over the defaults' goodput at
saturation (no collapse: >= 1).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import print_table, save_result  # noqa: E402

from firsttoken.bench.datasets import DatasetSpec, build_prompts  # noqa: E402
from firsttoken.bench.serve_client import LoadShape, ServeTarget, run_load  # noqa: E402
from firsttoken.bench.serve_stats import SLO, summarize_run  # noqa: E402
from firsttoken.bench.server_process import ServerProcess  # noqa: E402
from firsttoken.models.registry import default_model_path, open_checkpoint  # noqa: E402


def serve_once(options: dict, rate: float, seed: int, args: argparse.Namespace, tokenizer) -> dict:
    spec = DatasetSpec(
        num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len, seed=seed
    )
    prompts = build_prompts(spec, tokenizer)
    with ServerProcess(None, options) as server:
        target = ServeTarget(server.base_url, ignore_eos=True)
        run = asyncio.run(run_load(target, LoadShape(rate, seed=seed), prompts, show_progress=False))
    summary = summarize_run(run.records, run.duration_s, SLO(ttft_ms=args.ttft_slo_ms))
    return {
        "rate": rate,
        "options": options,
        "completed": summary.num_completed,
        "refused_or_failed": summary.num_failed,
        "goodput": summary.goodput,
        "attainment": summary.slo_attainment,
        "throughput": summary.request_throughput,
        "ttft_p50_ms": summary.ttft_ms.median,
        "ttft_p99_ms": summary.ttft_ms.p99,
        "tpot_p50_ms": summary.tpot_ms.median,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, required=True, help="the defaults' saturation rate, req/s")
    parser.add_argument("--ttft-slo-ms", type=float, required=True)
    parser.add_argument("--overload", type=float, default=1.5, help="rate multiple past saturation")
    parser.add_argument("--num-prompts", type=int, default=40)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=64)
    args = parser.parse_args()
    tokenizer = open_checkpoint(default_model_path()).tokenizer
    objective = {"ttft_slo_ms": args.ttft_slo_ms}
    overloaded = args.rate * args.overload
    runs = [
        ("defaults, saturation", {}, args.rate),
        ("defaults, overload", {}, overloaded),
        ("objective best_effort, overload", {**objective, "slo_policy": "best_effort"}, overloaded),
        ("objective refuse, overload", {**objective, "slo_policy": "refuse"}, overloaded),
    ]
    results = {}
    for name, options, rate in runs:
        # The overloaded runs send the same prompts at the same times: only the server differs.
        seed = 1 if rate == args.rate else 2
        results[name] = serve_once(options, rate, seed, args, tokenizer)
        print(f"{name}: {results[name]}", file=sys.stderr)
    baseline = results["defaults, saturation"]["goodput"]
    rows = [
        [
            name, result["rate"], result["completed"], result["refused_or_failed"], result["goodput"],
            result["attainment"] if result["attainment"] is not None else "-", result["ttft_p50_ms"],
            result["ttft_p99_ms"], result["tpot_p50_ms"], result["goodput"] / baseline if baseline else "-",
        ]
        for name, result in results.items()
    ]  # fmt: skip
    print(f"TTFT objective {args.ttft_slo_ms:g} ms; {args.input_len} in / {args.output_len} out")
    print_table(
        ["run", "req/s sent", "served", "refused/failed", "goodput", "attainment", "TTFT P50 ms",
         "TTFT P99 ms", "TPOT P50 ms", "goodput / saturation's"],
        rows,
    )  # fmt: skip
    print(save_result("ttft_objective", {"args": vars(args), "runs": results}))


if __name__ == "__main__":
    main()
