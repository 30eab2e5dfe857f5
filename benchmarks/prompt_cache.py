"""Prompt-cache benchmark: cold vs warm TTFT, and the first request after a restart.

    python benchmarks/prompt_cache.py [--prefix-len 512] [--suffix-len 32] [--repeats 7] [--dtype float32]

1. Cold: a prompt of prefix + suffix tokens that no cache has seen.
   Warm: the same prefix already cached, a new suffix: only the suffix is prefilled.
2. Restart: an engine started on a prompt-cache folder holding a pinned prefix, against an
   engine started without one; both measured on their first request (prefix + new suffix).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import interleaved_medians, print_table, random_prompt, save_result, timed  # noqa: E402

from firsttoken import LLM, SamplingParams  # noqa: E402

GREEDY_ONE = SamplingParams(temperature=0, max_tokens=1)


def first_token_seconds(llm: LLM, prompt: list[int]) -> float:
    return timed(lambda: llm.generate(prompt_token_ids=[prompt], sampling_params=GREEDY_ONE))


def cold_and_warm_medians(
    llm: LLM, shared_prefix: list[int], suffix_len: int, repeats: int
) -> dict[str, float]:
    """TTFT of fresh prompts as long as prefix + suffix, and of the cached prefix plus a fresh suffix."""

    def cold(run: int) -> float:
        return first_token_seconds(llm, random_prompt(len(shared_prefix) + suffix_len, seed=10_000 + run))

    llm.generate(
        prompt_token_ids=[shared_prefix + random_prompt(suffix_len, seed=2)], sampling_params=GREEDY_ONE
    )

    def warm(run: int) -> float:
        return first_token_seconds(llm, shared_prefix + random_prompt(suffix_len, seed=20_000 + run))

    return interleaved_medians({"cold": cold, "warm": warm}, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prefix-len", type=int, default=512)
    parser.add_argument("--suffix-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    options = dict(
        dtype=args.dtype, kv_cache_memory_bytes=512 << 20, chunk_size=4096, max_num_batched_tokens=4096
    )
    prefix_len, suffix_len = args.prefix_len, args.suffix_len
    shared_prefix = random_prompt(prefix_len, seed=1)
    # The engine of these runs is freed on return, before the restart runs load theirs.
    medians = cold_and_warm_medians(LLM(**options), shared_prefix, suffix_len, args.repeats)

    with tempfile.TemporaryDirectory() as folder:
        writer = LLM(**options, prompt_cache_dir=folder)
        writer.pin_prefix(shared_prefix, pin_id="bench-prefix")
        del writer

        def after_restart(run: int, persisted: bool) -> float:
            engine = LLM(**options, prompt_cache_dir=folder if persisted else None)
            return first_token_seconds(engine, shared_prefix + random_prompt(suffix_len, seed=30_000 + run))

        medians.update(
            interleaved_medians(
                {
                    "restart with persisted pin": lambda run: after_restart(run, True),
                    "restart without": lambda run: after_restart(run, False),
                },
                args.repeats,
            )
        )

    print(
        f"prompt cache, {args.dtype}, {prefix_len}-token prefix + {suffix_len} new tokens, median of "
        f"{args.repeats}, measured in turns"
    )
    print_table(
        ["case", "TTFT ms", "baseline ms", "ratio"],
        [
            [
                "warm prefix vs cold prompt",
                medians["warm"] * 1000,
                medians["cold"] * 1000,
                medians["warm"] / medians["cold"],
            ],
            [
                "first request after restart: persisted pin vs none",
                medians["restart with persisted pin"] * 1000,
                medians["restart without"] * 1000,
                medians["restart with persisted pin"] / medians["restart without"],
            ],
        ],
    )
    path = save_result(
        f"prompt_cache_{args.dtype}",
        {"prefix_len": prefix_len, "suffix_len": suffix_len, "median_ttft_s": medians},
    )
    print("saved", path)


if __name__ == "__main__":
    main()
