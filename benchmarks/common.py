"""Shared helpers of the benchmark scripts: prompts, timing, medians, and `firsttoken bench`'s tables
and result files (firsttoken/bench holds the user-facing verbs; these scripts build on them)."""

from __future__ import annotations

import os
import random
import statistics
import time
from typing import Callable


RESULTS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench_results")


def random_prompt(num_tokens: int, seed: int, vocab_low: int = 100, vocab_high: int = 49000) -> list[int]:
    """Token ids drawn uniformly: every run gets a prompt no cache has seen."""
    rng = random.Random(seed)
    return [rng.randrange(vocab_low, vocab_high) for _ in range(num_tokens)]


def interleaved_medians(
    runs: dict[str, Callable[[int], float]], repeats: int, warmups: int = 1
) -> dict[str, float]:
    """Median seconds of each run, taking turns (a, b, c, a, b, c, ...).

    This machine's speed drifts within minutes; measured in turns, every system sees the same
    drift, so their ratios hold even when the absolute times move. run(i) returns seconds.
    """
    samples: dict[str, list[float]] = {name: [] for name in runs}
    for index in range(-warmups, repeats):
        for name, run in runs.items():
            seconds = run(index)
            if index >= 0:
                samples[name].append(seconds)
    return {name: statistics.median(values) for name, values in samples.items()}


def first_token_run(llm, length: int, greedy_one, first_seed: int) -> Callable[[int], float]:
    """run(i) for `interleaved_medians`: the seconds `llm` (a firsttoken LLM) takes to prefill
    a fresh `length`-token prompt (seed first_seed + i) and sample one token with `greedy_one`."""
    return lambda index: timed(
        lambda: llm.generate(
            prompt_token_ids=[random_prompt(length, seed=first_seed + index)], sampling_params=greedy_one
        )
    )


def timed(function: Callable[[], object]) -> float:
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


def print_table(headers: list[str], rows: list[list[object]]) -> None:
    """`firsttoken bench`'s table, with a third decimal under 100 (the scripts' seconds and ratios)."""
    # Imported here: the vLLM side's Python imports this module and has no firsttoken.
    from firsttoken.bench.table import format_table

    print(format_table(headers, [[_format(value) for value in row] for row in rows]))


def _format(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 100 else f"{value:.1f}"
    return str(value)


def engine_dtype_name(llm) -> str:
    """The dtype an engine computes in, as `dtype="auto"` resolved it ("float32", "bfloat16")."""
    return llm.inspect().dtype


def save_result(name: str, payload: dict) -> str:
    os.makedirs(RESULTS_DIR, exist_ok=True)
    from firsttoken.bench.results import write_json

    return write_json(os.path.join(RESULTS_DIR, f"{name}.json"), payload)
