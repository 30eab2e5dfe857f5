"""The hand-written CPU kernels against the torch ops they replace, in one process, in turns.

    python bench/native_kernels.py [--lengths 16 128 512 2048] [--repeats 5] [--decode-tokens 64]

Two bf16 engines differ only in `native_kernels`: on, norms, rotary, SwiGLU and the KV write
are C kernels and prefill attention runs on AMX tiles (where the CPU has them); off, the
same steps are torch ops (inductor-compiled from 512 tokens, SDPA's flash kernel). Reports
TTFT per prompt length and decode tokens/s after a 512-token prompt (bf16 and int4 weights),
as medians and ratios on / off.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import interleaved_medians, print_table, random_prompt, save_result, timed  # noqa: E402

from firsttoken import LLM, SamplingParams  # noqa: E402
from firsttoken.models.registry import default_model_path  # noqa: E402

GREEDY_ONE = SamplingParams(temperature=0, max_tokens=1)
DECODE_PROMPT_LEN = 512
SETTINGS = {"native kernels": True, "torch ops": False}


def ttft_run(llm: LLM, length: int):
    return lambda index: timed(
        lambda: llm.generate(prompt_token_ids=[random_prompt(length, seed=9_000 + 10 * length + index)],
                             sampling_params=GREEDY_ONE)
    )


def decode_run(llm: LLM, num_tokens: int):
    """Seconds per generated token after the first (the decode steps only)."""
    params = SamplingParams(temperature=0, max_tokens=num_tokens + 1, ignore_eos=True)

    def run(index: int) -> float:
        prompt = random_prompt(DECODE_PROMPT_LEN, seed=9_500 + index)
        metrics = llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0].metrics
        return (metrics.last_token_time - metrics.first_token_time) / num_tokens

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[16, 128, 512, 2048])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--decode-tokens", type=int, default=64)
    args = parser.parse_args()
    path = default_model_path()
    max_len = max(max(args.lengths), DECODE_PROMPT_LEN + args.decode_tokens + 1)
    options = dict(dtype="bfloat16", enable_prompt_cache=False, chunk_size=max_len, max_num_batched_tokens=max_len)
    engines = {name: LLM(path, native_kernels=on, **options) for name, on in SETTINGS.items()}
    int4_engines = {name: LLM(path, native_kernels=on, quantization="int4", **options) for name, on in SETTINGS.items()}
    on, off = SETTINGS

    rows, ttft_results = [], {}
    for length in args.lengths:
        ttft = interleaved_medians({name: ttft_run(llm, length) for name, llm in engines.items()}, args.repeats)
        ttft_results[length] = ttft
        rows.append([length, ttft[on] * 1000, ttft[off] * 1000, ttft[on] / ttft[off]])
    print_table(["prompt tokens", f"TTFT ms, {on}", f"TTFT ms, {off}", "ratio"], rows)

    rows, decode_results = [], {}
    for weights, group in (("bf16", engines), ("int4", int4_engines)):
        per_token = interleaved_medians({name: decode_run(llm, args.decode_tokens) for name, llm in group.items()},
                                        args.repeats)
        decode_results[weights] = per_token
        rows.append([weights, 1 / per_token[on], 1 / per_token[off], per_token[off] / per_token[on]])
    print()
    print_table([f"decode after {DECODE_PROMPT_LEN} tokens", f"tokens/s, {on}", f"tokens/s, {off}", "speed-up"], rows)
    print("saved", save_result("native_kernels", {"ttft_s": ttft_results, "decode_s_per_token": decode_results}))


if __name__ == "__main__":
    main()
