"""TTFT and decode on a machine whose cores other processes keep busy: firsttoken's default
threads (adaptive) against `--num-threads 1`, and against OpenMP's idle threads asleep at once
(OMP_WAIT_POLICY=PASSIVE) instead of spinning first, each in a process of its own, in turns.

    python benchmarks/busy_machine.py [--busy 2] [--rounds 3] [--input-len 512] [--output-len 32]

`--busy N` starts N processes that spin on a core each (default: one per core) for the loaded
rows; the quiet rows run after they are stopped. Each row is `firsttoken bench latency` (the
median of its runs); a setting's figure is the median over rounds, the settings taking turns so
that the machine's drift touches each alike. Printed: TTFT and time per output token, and each
over `--num-threads 1`'s under the same load (below 1: faster than one thread).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import print_table, save_result  # noqa: E402

# name -> (extra `bench latency` flags, environment overrides). libgomp's idle threads spin some
# 3 ms before they sleep; OMP_WAIT_POLICY=PASSIVE makes them sleep at once, which leaves a busy
# core's time to the thread a region waits for, and costs every short region a wake-up.
SETTINGS: dict[str, tuple[list[str], dict[str, str]]] = {
    "default": ([], {}),
    "--num-threads 1": (["--num-threads", "1"], {}),
    "OMP_WAIT_POLICY=PASSIVE": ([], {"OMP_WAIT_POLICY": "PASSIVE"}),
}
BASELINE = "--num-threads 1"


def spin() -> None:
    while True:
        pass


def latency(args: argparse.Namespace, flags: list[str], environment: dict[str, str]) -> tuple[float, float]:
    """(TTFT s, time per output token s): one `firsttoken bench latency` process's medians."""
    command = [
        sys.executable, "-m", "firsttoken", "bench", "latency", "--json", "--no-progress",
        "--input-len", str(args.input_len), "--output-len", str(args.output_len),
        "--runs", str(args.runs), "--warmup-runs", "1", "--dtype", args.dtype, *flags,
    ]
    env = {**os.environ, **environment}
    completed = subprocess.run(command, env=env, capture_output=True, text=True, check=True, timeout=1800)
    median = json.loads(completed.stdout)["median"]
    return median["ttft_s"], median["tpot_s"]


def measure(args: argparse.Namespace, load: str) -> dict[str, tuple[float, float]]:
    """Each setting's medians over the rounds, the settings taking turns."""
    samples: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for _ in range(args.rounds):
        for name, (flags, environment) in SETTINGS.items():
            samples[name].append(latency(args, flags, environment))
            print(f"{load} {name}: TTFT {samples[name][-1][0] * 1e3:.1f} ms", file=sys.stderr)
    return {
        name: (statistics.median(t for t, _ in runs), statistics.median(p for _, p in runs))
        for name, runs in samples.items()
    }


def rows_of(load: str, figures: dict[str, tuple[float, float]]) -> list[list[object]]:
    base_ttft, base_tpot = figures[BASELINE]
    return [
        [load, name, ttft * 1e3, tpot * 1e3, ttft / base_ttft, tpot / base_tpot]
        for name, (ttft, tpot) in figures.items()
    ]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--busy", type=int, default=os.cpu_count() or 1, help="spinning processes")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--runs", type=int, default=3, help="timed requests per `bench latency` process")
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--skip-quiet", action="store_true", help="measure only beside the busy processes")
    args = parser.parse_args()
    spinners = [multiprocessing.Process(target=spin, daemon=True) for _ in range(args.busy)]
    for spinner in spinners:
        spinner.start()
    try:
        loaded = measure(args, f"{args.busy} busy")
    finally:
        for spinner in spinners:
            spinner.terminate()
            spinner.join()
    rows = rows_of(f"{args.busy} busy", loaded)
    if not args.skip_quiet:
        rows += rows_of("quiet", measure(args, "quiet"))
    headers = ["load", "setting", "TTFT ms", "TPOT ms", "TTFT / 1 thread", "TPOT / 1 thread"]
    print_table(headers, rows)
    path = save_result("busy_machine", {"args": vars(args), "headers": headers, "rows": rows})
    print(f"saved {path}")


if __name__ == "__main__":
    main()
