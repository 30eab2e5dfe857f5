"""chunk_size auto against fixed chunks, served: a `firsttoken serve` per setting, all up at once,
the same Poisson arrivals and prompts for every setting, rates as fractions of this machine's
measured capacity.

    python benchmarks/chunk_policy.py [--loads 512/64 2048/128] [--fractions 0.5 1 1.5]
        [--chunks 256 512 1024 2048] [--num-prompts 24] [--rounds 2] [--firsttoken-args "--dtype float32"]
    python benchmarks/chunk_policy.py --simulate    # the same sweep on this machine's step-cost model

Capacity is measured first for each load: a burst of prompts all sent at once to the server that
runs whole prefills (chunk size = max_num_batched_tokens), completed requests per second. At each
fraction of it the settings then take turns, round after round (each round its own prompts and
arrivals, the same for every setting), so a drift of the machine's speed falls on all alike; a
setting's figures pool its rounds. Printed per load and rate: TTFT P50 / P99, TPOT P50 / P99,
goodput (requests per second meeting the TTFT and TPOT objectives: 4 times the burst's fastest
TTFT and TPOT) and achieved rate; then auto over the best fixed chunk (the one with the lowest TTFT
P50 at that point) on each figure.

`--simulate` loads an engine once, takes the step-cost model it measured at start, and runs the sweep
on the scheduler with that model as its device (bench/schedule_sim.py): seconds instead of minutes,
and no noise, but none of what a real server adds (HTTP, tokenizing, the cost model's error).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import math
import os
import shlex
import sys
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import print_table, save_result  # noqa: E402

from firsttoken.bench.datasets import DatasetSpec, build_prompts  # noqa: E402
from firsttoken.bench.schedule_sim import SimulatedLoad, sweep_chunk_policies  # noqa: E402
from firsttoken.bench.serve_client import LoadShape, ServeRun, ServeTarget, run_load  # noqa: E402
from firsttoken.bench.serve_stats import SLO, ServeSummary, summarize_run  # noqa: E402
from firsttoken.bench.server_process import ServerProcess  # noqa: E402
from firsttoken.config import ChunkedPrefillConfig  # noqa: E402
from firsttoken.engine_args import engine_kwargs  # noqa: E402

MAX_NUM_BATCHED_TOKENS = 2048
# Every setting's server is up at once: a KV cache each that holds a run's requests, not 40% of memory.
KV_CACHE_BYTES = 3 << 29
FIGURES = ("TTFT P50", "TTFT P99", "TPOT P50", "TPOT P99", "goodput", "achieved")


@dataclass(frozen=True)
class Load:
    input_len: int
    output_len: int

    @classmethod
    def parse(cls, text: str) -> Load:
        input_len, output_len = (int(part) for part in text.split("/"))
        return cls(input_len, output_len)

    @property
    def label(self) -> str:
        return f"{self.input_len}/{self.output_len}"


def figures_of(summary: ServeSummary) -> dict[str, float]:
    return {
        "TTFT P50": summary.ttft_ms.median,
        "TTFT P99": summary.ttft_ms.p99,
        "TPOT P50": summary.tpot_ms.median,
        "TPOT P99": summary.tpot_ms.p99,
        "goodput": summary.goodput,
        "achieved": summary.request_throughput,
    }


@functools.cache
def prompt_tokenizer():
    """The embedded model's tokenizer, which sizes the prompts in its tokens."""
    from firsttoken.models.registry import default_model_path, open_checkpoint

    return open_checkpoint(default_model_path()).tokenizer


def send(server: ServerProcess, load: Load, num_prompts: int, rate: float, seed: int) -> ServeRun:
    spec = DatasetSpec(
        num_prompts=num_prompts, input_len=load.input_len, output_len=load.output_len, seed=seed
    )
    prompts = build_prompts(spec, prompt_tokenizer())
    target = ServeTarget(server.base_url, ignore_eos=True)
    return asyncio.run(run_load(target, LoadShape(rate, seed=seed), prompts, show_progress=False))


def measure_capacity(server: ServerProcess, load: Load, num_prompts: int) -> tuple[float, SLO]:
    """Requests per second a burst completes on `server` (whole prefills), and the objectives this
    machine's own unloaded figures suggest (from the burst's fastest request)."""
    run = send(server, load, num_prompts, math.inf, seed=1000)
    burst = summarize_run(run.records, run.duration_s, SLO())
    slo = SLO(ttft_ms=4 * burst.ttft_ms.min, tpot_ms=4 * burst.tpot_ms.min)
    return burst.request_throughput, slo


def served_sweep(args: argparse.Namespace, settings: dict[str, dict]) -> dict:
    """Every setting's server up at once; at each rate the settings take turns, round after round
    (each round its own prompts and arrivals, the same for every setting), so a drift of the
    machine's speed falls on all of them alike. A setting's figures pool its rounds' requests."""
    base = {
        "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
        "kv_cache_memory_bytes": KV_CACHE_BYTES,
        **engine_kwargs(_engine_args(args.firsttoken_args)),
    }
    whole_label = str(MAX_NUM_BATCHED_TOKENS)
    all_settings = {whole_label: {"chunk_size": MAX_NUM_BATCHED_TOKENS}, **settings}
    results: dict = {}
    with contextlib.ExitStack() as stack:
        servers = {
            label: stack.enter_context(ServerProcess(None, {**base, **options}))
            for label, options in all_settings.items()
        }
        for load in args.loads:
            for server in servers.values():
                send(server, load, 2, math.inf, seed=999)  # the first requests pay one-time costs
            capacity, slo = measure_capacity(servers[whole_label], load, args.num_prompts)
            print(
                f"{load.label}: capacity {capacity:.3f} req/s (burst, whole prefills); "
                f"objectives TTFT {slo.ttft_ms:.0f} ms, TPOT {slo.tpot_ms:.0f} ms",
                flush=True,
            )
            rates = {fraction: fraction * capacity for fraction in args.fractions}
            by_setting: dict[str, dict[float, dict[str, float]]] = {label: {} for label in settings}
            for fraction, rate in rates.items():
                runs: dict[str, list[ServeRun]] = {label: [] for label in settings}
                for round_index in range(args.rounds):
                    seed = 100 * round_index + int(fraction * 10)
                    for label in settings:
                        runs[label].append(send(servers[label], load, args.num_prompts, rate, seed))
                for label, label_runs in runs.items():
                    records = [record for run in label_runs for record in run.records]
                    duration_s = sum(run.duration_s for run in label_runs)
                    by_setting[label][fraction] = figures_of(summarize_run(records, duration_s, slo))
                progress = (
                    f"{label} {by_setting[label][fraction]['TTFT P50']:.0f} / "
                    f"{by_setting[label][fraction]['TPOT P50']:.0f} ms"
                    for label in settings
                )
                print(f"  {fraction}x, TTFT P50 / TPOT P50: " + "; ".join(progress), flush=True)
            results[load.label] = {"capacity": capacity, "rates": rates, "settings": by_setting}
    return results


def simulated_sweep(args: argparse.Namespace, settings: dict[str, dict]) -> dict:
    from firsttoken import LLM

    llm = LLM(
        **{
            "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
            **engine_kwargs(_engine_args(args.firsttoken_args)),
        }
    )
    cost_model = llm.core.scheduler.step_times.model
    print(f"step-cost model measured at start: {cost_model}")
    loads = [
        SimulatedLoad(load.input_len, load.output_len, args.num_prompts, rate=0.0) for load in args.loads
    ]
    configs = {label: ChunkedPrefillConfig(**options) for label, options in settings.items()}
    results: dict = {}
    for point in sweep_chunk_policies(cost_model, loads, args.fractions, configs):
        label = f"{point.load.input_len}/{point.load.output_len}"
        entry = results.setdefault(
            label, {"capacity": point.load.rate / point.capacity_fraction, "rates": {}, "settings": {}}
        )
        entry["rates"][point.capacity_fraction] = point.load.rate
        for figures in point.figures:
            entry["settings"].setdefault(figures.label, {})[point.capacity_fraction] = {
                "TTFT P50": figures.ttft_p50_ms,
                "TTFT P99": figures.ttft_p99_ms,
                "TPOT P50": figures.tpot_p50_ms,
                "TPOT P99": figures.tpot_p99_ms,
            }
    return results


def print_results(results: dict, fixed_labels: list[str]) -> None:
    for load_label, entry in results.items():
        print(f"\n{load_label}, capacity {entry['capacity']:.3f} req/s")
        settings = entry["settings"]
        names = [name for name in FIGURES if name in next(iter(next(iter(settings.values())).values()))]
        rows = []
        for fraction, rate in entry["rates"].items():
            for label, by_fraction in settings.items():
                rows.append(
                    [f"{fraction}x ({rate:.2f}/s)", label, *(by_fraction[fraction][name] for name in names)]
                )
            best = min(fixed_labels, key=lambda label: settings[label][fraction]["TTFT P50"])
            auto = settings["auto"][fraction]
            rows.append(
                [
                    f"{fraction}x",
                    f"auto / {best}",
                    *(_ratio(auto[name], settings[best][fraction][name]) for name in names),
                ]
            )
        print_table(["rate", "setting", *names], rows)


def _ratio(auto: float, best: float) -> float:
    """auto's figure over the best fixed chunk's; nan where that is 0 (no request met every
    objective: goodput 0, as a short run on a slow machine can give)."""
    return auto / best if best else math.nan


def _engine_args(text: str) -> argparse.Namespace:
    from firsttoken.engine_args import add_engine_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return parser.parse_args(shlex.split(text))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--loads", nargs="+", type=Load.parse, default=[Load(512, 64), Load(2048, 128)])
    parser.add_argument("--fractions", nargs="+", type=float, default=[0.5, 1.0, 1.5])
    parser.add_argument("--chunks", nargs="+", type=int, default=[256, 512, 1024, 2048])
    parser.add_argument(
        "--num-prompts", type=int, default=24, help="requests per rate and round (default: 24)"
    )
    parser.add_argument("--rounds", type=int, default=2, help="rounds of every setting in turns (default: 2)")
    parser.add_argument("--firsttoken-args", default="", help="engine flags every server gets")
    parser.add_argument("--simulate", action="store_true", help="the sweep on this machine's step-cost model")
    args = parser.parse_args()
    fixed_labels = [str(chunk) for chunk in args.chunks]
    settings = {
        "auto": {"chunk_size": "auto"},
        **{str(chunk): {"chunk_size": chunk} for chunk in args.chunks},
    }
    results = simulated_sweep(args, settings) if args.simulate else served_sweep(args, settings)
    print_results(results, fixed_labels)
    path = save_result("chunk_policy_simulated" if args.simulate else "chunk_policy", results)
    print(f"\nsaved {path}")


if __name__ == "__main__":
    main()
