"""What structured output costs: TTFT of a short constrained chat request against the same
request unconstrained, and the sampler's step with and without constrained rows.

    python benchmarks/structured_output.py [--repeats 30] [--dtype auto]

TTFT (through AsyncEngine, as the server runs it: arrival to first delta, one request at a time,
max_tokens 1, the same chat prompt, a fresh prompt-cache miss each time), in turns:
- plain: no constraint;
- schema (cached): a JSON schema compiled by an earlier request (the common case: an
  application sends the same schema again);
- schema (new): a schema never seen before (a property renamed each time), compiled on arrival.
Printed: medians and their ratios to plain (the goal: cached <= 1.05).

Sampler (--rows rows of logits over the vocabulary, greedy): a step with no constrained row,
with one, and with every row constrained; medians in microseconds. A step without a constrained
row runs no grammar code at all (the rows are checked for parameters that process logits first).

On a machine shared with other work the ratios, timed in turns, hold better than the absolute
times.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import interleaved_medians, print_table  # noqa: E402

from firsttoken.core.batch import SampleSpec, ScheduledChunk, SchedulerOutput, TrackedRequest  # noqa: E402
from firsttoken.engine import AsyncEngine  # noqa: E402
from firsttoken.sample.grammar import GrammarCompiler  # noqa: E402
from firsttoken.sample.sampler import Sampler  # noqa: E402
from firsttoken.sampling_params import SamplingParams, StructuredOutput  # noqa: E402


def person_schema(key: str) -> str:
    return json.dumps({
        "type": "object",
        "properties": {key: {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}},
        "required": [key, "age"],
    })


async def first_token_seconds(engine: AsyncEngine, index: int, structured: StructuredOutput | None) -> float:
    # A different question each time: no run reuses another's cached prompt.
    messages = [{"role": "user", "content": f"Describe person number {index} as JSON."}]
    params = SamplingParams(temperature=0, max_tokens=1, structured_output=structured)
    started = time.perf_counter()
    async for _ in engine.generate(messages=messages, sampling_params=params):
        return time.perf_counter() - started
    raise RuntimeError("no delta")


async def measure_ttft(engine: AsyncEngine, repeats: int) -> dict[str, float]:
    await engine.start()
    cached = StructuredOutput(json_schema=person_schema("name"))
    samples: dict[str, list[float]] = {"plain": [], "schema (cached)": [], "schema (new)": []}
    request_index = 0
    for turn in range(-2, repeats):  # two warm-up turns
        for name in samples:
            request_index += 1
            structured = {
                "plain": None,
                "schema (cached)": cached,
                "schema (new)": StructuredOutput(json_schema=person_schema(f"name_{turn}_{request_index}")),
            }[name]
            seconds = await first_token_seconds(engine, request_index, structured)
            if turn >= 0:
                samples[name].append(seconds)
    await engine.shutdown()
    return {name: statistics.median(values) for name, values in samples.items()}


def measure_sampler(engine: AsyncEngine, num_rows: int, repeats: int) -> dict[str, float]:
    tokenizer = engine.tokenizer
    vocab_size = engine.vocab_size
    compiler = GrammarCompiler(tokenizer, vocab_size)
    structured = StructuredOutput(json_schema=person_schema("name"))
    constrained = SamplingParams(temperature=0, max_tokens=64, structured_output=structured)
    plain = SamplingParams(temperature=0, max_tokens=64)

    def sampler_with(num_constrained: int) -> tuple[Sampler, list[SampleSpec]]:
        sampler = Sampler(0, torch.device("cpu"), vocab_size)
        params = [constrained] * num_constrained + [plain] * (num_rows - num_constrained)
        tracked = [
            TrackedRequest(f"r{row}", p, [1], (2,), (), compiler.compile(structured))
            for row, p in enumerate(params) if p.structured_output is not None
        ]
        sampler.begin_step(
            SchedulerOutput([ScheduledChunk(f"r{row}", [1], 0, [], None) for row in range(num_rows)], tracked)
        )
        return sampler, [SampleSpec(p, 0, f"r{row}") for row, p in enumerate(params)]

    setups = {
        "no constrained row": sampler_with(0),
        "1 constrained row": sampler_with(1),
        f"{num_rows} constrained rows": sampler_with(num_rows),
    }
    logits = torch.randn(num_rows, vocab_size)

    def run(name: str):
        sampler, specs = setups[name]
        return lambda _: _timed(lambda: sampler.sample(logits.clone(), specs))

    return interleaved_medians({name: run(name) for name in setups}, repeats, warmups=3)


def _timed(function) -> float:
    started = time.perf_counter()
    function()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    engine = AsyncEngine.from_options(dtype=args.dtype)
    ttft = asyncio.run(measure_ttft(engine, args.repeats))
    print(f"TTFT, one short chat request at a time, medians of {args.repeats}:")
    print_table(
        ["request", "TTFT ms", "/ plain"],
        [[name, seconds * 1e3, seconds / ttft["plain"]] for name, seconds in ttft.items()],
    )
    sampler = measure_sampler(engine, args.rows, args.repeats * 10)
    base = sampler["no constrained row"]
    print(f"\nSampler step, {args.rows} greedy rows, medians of {args.repeats * 10}:")
    print_table(
        ["step", "us", "/ none"], [[name, seconds * 1e6, seconds / base] for name, seconds in sampler.items()]
    )


if __name__ == "__main__":
    main()
