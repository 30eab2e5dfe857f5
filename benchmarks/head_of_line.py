"""Head-of-line benchmark: a long prompt arrives while streams decode and short prompts keep coming.

    python benchmarks/head_of_line.py [--long-len 4096] [--short-len 64] [--streams 8] [--dtype auto]

In one process, for chunking off, fixed 512, fixed 2048 and auto: 8 streams are decoding; at
t=0 a long prompt arrives; a short prompt arrives every 100 ms for 5 s. Requests are stamped
with their scheduled arrival time, as a server's front end would stamp them while the engine
is busy. Printed: the short requests' P50/P99 TTFT, the streams' max and P99 inter-token
latency (and their unloaded ITL, measured just before), the long prompt's TTFT, throughput.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import print_table, random_prompt, save_result  # noqa: E402

from firsttoken import LLM, SamplingParams  # noqa: E402

CONFIGS = {
    "chunking off": dict(enable_chunked_prefill=False),
    "fixed 512": dict(chunk_size=512),
    "fixed 2048": dict(chunk_size=2048),
    "auto": dict(chunk_size="auto"),
    "auto, min chunk 32": dict(chunk_size="auto", min_chunk_size=32),
}


@dataclass
class ScenarioResult:
    short_ttft_s: list[float] = field(default_factory=list)
    stream_itl_s: list[float] = field(default_factory=list)
    unloaded_itl_s: list[float] = field(default_factory=list)
    long_ttft_s: float = 0.0
    tokens_computed: int = 0
    elapsed_s: float = 0.0


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def run_scenario(options: dict, args: argparse.Namespace) -> ScenarioResult:
    llm = LLM(
        dtype=args.dtype, enable_prompt_cache=False, max_num_batched_tokens=2048,
        kv_cache_memory_bytes=1 << 30, **options,
    )
    engine = llm.core
    result = ScenarioResult()
    stream_ids = [f"stream-{index}" for index in range(args.streams)]
    stream_params = SamplingParams(temperature=0, max_tokens=4000, ignore_eos=True)
    for index, stream_id in enumerate(stream_ids):
        engine.add_request(stream_id, random_prompt(32, seed=index), stream_params)
    last_token_at: dict[str, float] = {}

    def step_and_record(window_open: bool) -> list:
        deltas = engine.step()
        now = time.perf_counter()
        for delta in deltas:
            if delta.req_id in last_token_at and delta.token_ids:
                gap = now - last_token_at[delta.req_id]
                (result.stream_itl_s if window_open else result.unloaded_itl_s).append(gap)
            if delta.req_id.startswith("stream"):
                last_token_at[delta.req_id] = now
        return deltas

    while len(last_token_at) < len(stream_ids):
        step_and_record(window_open=False)
    for _ in range(20):  # the streams alone: their unloaded inter-token latency
        step_and_record(window_open=False)
    result.unloaded_itl_s = result.unloaded_itl_s[-20 * len(stream_ids) :]

    computed_before = engine.stats().num_prefill_tokens + engine.stats().num_decode_tokens
    start = time.perf_counter()
    arrivals = [(start, "long", random_prompt(args.long_len, seed=99))]
    arrivals += [
        (start + 0.1 * index, f"short-{index}", random_prompt(args.short_len, seed=1000 + index))
        for index in range(1, int(args.duration / 0.1) + 1)
    ]
    arrival_of = {req_id: at for at, req_id, _ in arrivals}
    pending = sorted(arrivals)
    outstanding = set(arrival_of)
    one_token = SamplingParams(temperature=0, max_tokens=1)
    while outstanding:
        now = time.perf_counter()
        while pending and pending[0][0] <= now:
            at, req_id, prompt = pending.pop(0)
            engine.add_request(req_id, prompt, one_token, arrival_time=at)
        for delta in step_and_record(window_open=True):
            if delta.req_id in outstanding and delta.token_ids:
                ttft = time.perf_counter() - arrival_of[delta.req_id]
                if delta.req_id == "long":
                    result.long_ttft_s = ttft
                else:
                    result.short_ttft_s.append(ttft)
                outstanding.discard(delta.req_id)
    result.elapsed_s = time.perf_counter() - start
    result.tokens_computed = (
        engine.stats().num_prefill_tokens + engine.stats().num_decode_tokens - computed_before
    )
    for stream_id in stream_ids:
        engine.abort_request(stream_id)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--long-len", type=int, default=4096)
    parser.add_argument("--short-len", type=int, default=64)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--duration", type=float, default=5.0, help="seconds over which short prompts arrive")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS)[:4], choices=list(CONFIGS))
    args = parser.parse_args()

    results = {name: run_scenario(CONFIGS[name], args) for name in args.configs}
    rows = []
    for name, result in results.items():
        rows.append([
            name,
            statistics.median(result.short_ttft_s) * 1000,
            percentile(result.short_ttft_s, 99) * 1000,
            max(result.stream_itl_s) * 1000,
            percentile(result.stream_itl_s, 99) * 1000,
            statistics.median(result.unloaded_itl_s) * 1000,
            result.long_ttft_s * 1000,
            result.tokens_computed / result.elapsed_s,
        ])
    print(
        f"head of line: {args.streams} streams, one {args.long_len}-token prompt at t=0, "
        f"a {args.short_len}-token prompt every 100 ms for {args.duration:.0f} s (dtype {args.dtype})"
    )
    print_table(
        [
            "config",
            "short P50 ms",
            "short P99 ms",
            "stream max ITL ms",
            "stream P99 ITL ms",
            "unloaded ITL ms",
            "long TTFT ms",
            "tokens/s",
        ],
        rows,
    )
    if "auto" in results and "chunking off" in results:
        auto, off = results["auto"], results["chunking off"]
        print("auto vs chunking off:")
        print(
            f"  short P99 TTFT ratio "
            f"{percentile(auto.short_ttft_s, 99) / percentile(off.short_ttft_s, 99):.3f} (target <= 0.333)"
        )
        print(
            f"  stream P99 ITL / unloaded ITL "
            f"{percentile(auto.stream_itl_s, 99) / statistics.median(auto.unloaded_itl_s):.2f} (target <= 2)"
        )
        print(f"  long TTFT ratio {auto.long_ttft_s / off.long_ttft_s:.3f} (target <= 1.3)")
    path = save_result("head_of_line", {name: vars(result) for name, result in results.items()})
    print("saved", path)


if __name__ == "__main__":
    main()
