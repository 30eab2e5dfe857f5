"""What tensor parallelism does on this machine: TTFT and decode speed at TP=1 and TP=2, and
the time rank 0 spends in all-reduces per step.

    python benchmarks/tensor_parallel.py [--input-lens 128 512] [--decode-batches 1 8] [--repeats 5]

Two engines on the embedded model (default dtype), one process each rank: TP=1 on all the
physical cores, TP=2 on half of them per rank (so both use the same cores), timed in turns in
one run, each with its default threads: TP=1's thread governor drops a thread while another
process holds a core; with ranks it is off (`--fixed-threads` turns it off for TP=1 too).
TTFT: one fresh prompt alone. Decode: tokens per second of a batch of streams with
256-token prompts, 32 steps each. All-reduce: seconds rank 0 spends inside all_reduce calls per
step (the transfer, and the wait for the slower rank), and their share of the step.
Prints medians and ratios; the JSON goes to bench_results/.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import interleaved_medians, print_table, random_prompt, save_result, timed  # noqa: E402

from firsttoken import LLM, SamplingParams  # noqa: E402

FIRST_TOKEN = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
DECODE_STEPS = 32


class AllReduceClock:
    """Per-step seconds and counts of rank 0's all-reduces over the timed sections of runs."""

    def __init__(self, llm: LLM) -> None:
        self.group = llm.core.executor.rank_group
        self.seconds_per_step: list[float] = []
        self.calls_per_step: list[float] = []
        self.step_seconds: list[float] = []

    def measure(self, run_steps, num_steps: int) -> float:
        """Run `run_steps`; its seconds. Records the all-reduce time of its `num_steps` steps."""
        if self.group is None:
            return timed(run_steps)
        seconds_before, calls_before = self.group.all_reduce_seconds, self.group.num_all_reduces
        seconds = timed(run_steps)
        self.seconds_per_step.append((self.group.all_reduce_seconds - seconds_before) / num_steps)
        self.calls_per_step.append((self.group.num_all_reduces - calls_before) / num_steps)
        self.step_seconds.append(seconds / num_steps)
        return seconds


def ttft_run(llm: LLM, clock: AllReduceClock, input_len: int):
    def run(index: int) -> float:
        prompt = random_prompt(input_len, seed=index)
        return clock.measure(lambda: llm.generate(prompt_token_ids=[prompt], sampling_params=FIRST_TOKEN), 1)

    return run


def decode_run(llm: LLM, clock: AllReduceClock, batch: int):
    params = SamplingParams(temperature=0, max_tokens=DECODE_STEPS + 1, ignore_eos=True)

    def run(index: int) -> float:
        core = llm.core
        ids = [core.new_req_id() for _ in range(batch)]
        for offset, req_id in enumerate(ids):
            core.add_request(req_id, random_prompt(256, seed=1000 * index + offset), params)
        while any(core.scheduler.requests[req_id].num_output_tokens == 0 for req_id in ids):
            core.step()
        seconds = clock.measure(lambda: [core.step() for _ in range(DECODE_STEPS)], DECODE_STEPS)
        while core.has_unfinished_requests():
            core.step()
        return batch * DECODE_STEPS / seconds

    return run


def all_reduce_row(label: str, clock: AllReduceClock) -> list[object]:
    per_step = statistics.median(clock.seconds_per_step)
    share = statistics.median(a / s for a, s in zip(clock.seconds_per_step, clock.step_seconds))
    calls = statistics.median(clock.calls_per_step)
    clock.seconds_per_step, clock.calls_per_step, clock.step_seconds = [], [], []
    return [label, per_step * 1000, calls, share]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input-lens", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--decode-batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--fixed-threads", action="store_true", help="TP=1 without the thread governor")
    args = parser.parse_args()
    options = dict(enable_prompt_cache=False, kv_cache_memory_bytes=256 << 20, chunk_size=2048,
                   adaptive_threads=not args.fixed_threads)
    engines = {"tp1": LLM(**options), "tp2": LLM(**options, tensor_parallel_size=2)}
    clocks = {name: AllReduceClock(llm) for name, llm in engines.items()}
    inspections = {name: llm.inspect() for name, llm in engines.items()}
    print(f"tp1: {inspections['tp1'].description}, {inspections['tp1'].num_threads} threads")
    print(f"tp2: {inspections['tp2'].description}, {inspections['tp2'].num_threads} threads per rank")
    rows, reduce_rows, payload = [], [], {}
    for input_len in args.input_lens:
        runs = {name: ttft_run(llm, clocks[name], input_len) for name, llm in engines.items()}
        medians = interleaved_medians(runs, args.repeats)
        rows.append([f"TTFT {input_len} tokens (ms)", medians["tp1"] * 1000, medians["tp2"] * 1000,
                     medians["tp2"] / medians["tp1"]])
        reduce_rows.append(all_reduce_row(f"prefill {input_len} tokens", clocks["tp2"]))
        payload[f"ttft_{input_len}_s"] = medians
    for batch in args.decode_batches:
        runs = {name: decode_run(llm, clocks[name], batch) for name, llm in engines.items()}
        medians = interleaved_medians(runs, args.repeats)
        rows.append([f"decode batch {batch} (tokens/s)", medians["tp1"], medians["tp2"],
                     medians["tp1"] / medians["tp2"]])
        reduce_rows.append(all_reduce_row(f"decode batch {batch}", clocks["tp2"]))
        payload[f"decode_batch_{batch}_tokens_per_s"] = medians
    print_table(["measure", "TP=1", "TP=2", "TP=2 time / TP=1 time"], rows)
    print()
    print_table(["TP=2 step", "all-reduce ms / step", "all-reduces / step", "share of the step"], reduce_rows)
    payload["all_reduce"] = [
        dict(zip(["step", "ms_per_step", "calls_per_step", "share"], row)) for row in reduce_rows
    ]
    print(f"saved {save_result('tensor_parallel', payload)}")
    engines["tp2"].shutdown()


if __name__ == "__main__":
    main()
