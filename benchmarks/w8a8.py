"""W8A8 against the float engines on this CPU: quality on a fixed text, then TTFT.

    python benchmarks/w8a8.py [--text /usr/share/common-licenses/GPL-3] [--windows 4]
                              [--lengths 512 2048] [--rounds 3] [--repeats 5]
                              [--dtypes float32 bfloat16]

Quality: the text cut into windows of 1024 tokens, each scored in one prefill
(`prompt_logprobs`): perplexity, and teacher-forced top-1 agreement with float32 (the share of
positions where an engine's likeliest next token is float32's). "w8a8 smoothed" engines use input
maxima calibrated as `firsttoken quantize` does, on the 2048 tokens after the scored windows
(`--calibration-tokens`);
"w8a8 rotated" engines turn the model first (`w8a8_rotation`, no calibration); "w8a8 rotated
gptq" engines multiply the turned weights as `firsttoken quantize --method gptq` rounds them over
the same 2048 tokens.
Speed: TTFT of fresh prompts, each engine in a process of its own (as a server runs it: with
several engines in one process each meets its weights where the others evicted them, which cost
bf16, twice W8A8's weight bytes, the most), the engines' processes in turns for `--rounds` rounds,
`--repeats` prompts per length in each after an untimed one; the ratio is to the fastest float
engine's median TTFT.

Another CPU class on this one: oneDNN's `ONEDNN_MAX_CPU_ISA` and firsttoken's `FIRSTTOKEN_ISA`
hold both below what the CPU has, e.g. a Cascade Lake or Ice Lake server (AVX512-VNNI, no bf16
instructions) on a newer one: `ONEDNN_MAX_CPU_ISA=AVX512_CORE_VNNI FIRSTTOKEN_ISA=avx512 python
benchmarks/w8a8.py --dtypes float32` (bf16 there is emulated, so not a float engine to beat).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import math
import multiprocessing
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import first_token_run, print_table, save_result  # noqa: E402

from firsttoken import LLM, SamplingParams  # noqa: E402
from firsttoken.models.registry import default_model_path  # noqa: E402
from firsttoken.calibration.calibrate import (  # noqa: E402
    DEFAULT_CALIBRATION_TOKENS,
    calibrate,
    calibration_prompts,
    record_activation_maxima,
)
from firsttoken.worker.activation_stats import save_activation_maxima  # noqa: E402

WINDOW_TOKENS = 1024
REFERENCE = "float32"
QUANTIZATIONS = {"": {}, "w8a8, ": {"quantization": "w8a8"}}
SCORE = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
GREEDY_ONE = SamplingParams(temperature=0, max_tokens=1)


def text_windows(llm: LLM, path: str, count: int) -> list[list[int]]:
    with open(path, encoding="utf-8") as handle:
        token_ids = llm.tokenizer.encode(handle.read())
    windows = [token_ids[start : start + WINDOW_TOKENS] for start in range(0, len(token_ids), WINDOW_TOKENS)]
    return [window for window in windows if len(window) == WINDOW_TOKENS][:count]


def calibration_files(
    llm: LLM, path: str, skipped_tokens: int, num_tokens: int, directory: str
) -> tuple[str, str]:
    """Calibrated on the text's `num_tokens` after `skipped_tokens`, in chat prompts, as
    `firsttoken quantize` runs them, saved in `directory`: the input maxima of `llm`, and the
    turned weights rounded by GPTQ; returns the two files' paths."""
    with open(path, encoding="utf-8") as handle:
        after_scored = llm.tokenizer.decode(llm.tokenizer.encode(handle.read())[skipped_tokens:])
    prompts = calibration_prompts(llm, after_scored, num_tokens, chat_template=True)
    stats_path = os.path.join(directory, "w8a8_maxima.safetensors")
    save_activation_maxima(stats_path, record_activation_maxima(llm, prompts))
    weights_path = os.path.join(directory, "w8a8_gptq.safetensors")
    calibrate(default_model_path(), after_scored, num_tokens, weights_path, method="gptq")
    return stats_path, weights_path


def scored_positions(llm: LLM, windows: list[list[int]]) -> list[tuple[float, int]]:
    """(logprob of the text's token, the engine's likeliest token) at every scored position."""
    positions = []
    for output in llm.generate(prompt_token_ids=windows, sampling_params=SCORE):
        for entry in output.prompt_logprobs[1:]:
            positions.append((entry.logprob, entry.top_logprobs[0].token_id))
    return positions


def quality_rows(scores: dict[str, list[tuple[float, int]]]) -> list[list[object]]:
    reference = scores[REFERENCE]
    reference_perplexity = _perplexity(reference)
    rows = []
    for name, positions in scores.items():
        agreeing = sum(mine[1] == theirs[1] for mine, theirs in zip(positions, reference, strict=True))
        perplexity = _perplexity(positions)
        rows.append([name, perplexity, perplexity / reference_perplexity, agreeing / len(reference)])
    return rows


def first_token_seconds(
    options: dict[str, object], lengths: list[int], repeats: int
) -> dict[int, list[float]]:
    """An engine with `options` started here: the seconds of `repeats` fresh prompts of each
    length (each prompt of its own, after an untimed one)."""
    llm = LLM(default_model_path(), **options)
    try:
        samples = {}
        for length in lengths:
            run = first_token_run(llm, length, GREEDY_ONE, 9_000)
            run(-1)
            samples[length] = [run(index) for index in range(repeats)]
        return samples
    finally:
        llm.shutdown()


def first_token_seconds_alone(
    options: dict[str, object], lengths: list[int], repeats: int
) -> dict[int, list[float]]:
    """`first_token_seconds` in a fresh process (spawned: no state of this one's engines)."""
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        return pool.submit(first_token_seconds, options, lengths, repeats).result()


def _perplexity(positions: list[tuple[float, int]]) -> float:
    return math.exp(-sum(logprob for logprob, _ in positions) / len(positions))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--text", default="/usr/share/common-licenses/GPL-3")
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--rounds", type=int, default=3, help="processes per engine, in turns")
    parser.add_argument("--repeats", type=int, default=5, help="timed prompts per length and process")
    parser.add_argument(
        "--calibration-tokens", type=int, default=DEFAULT_CALIBRATION_TOKENS,
        help=f"tokens after the scored windows that calibrate (default: {DEFAULT_CALIBRATION_TOKENS})",
    )
    parser.add_argument(
        "--dtypes", nargs="+", choices=["float32", "bfloat16"], default=["float32", "bfloat16"]
    )
    args = parser.parse_args()
    longest = max(max(args.lengths), WINDOW_TOKENS)
    common = dict(
        enable_prompt_cache=False, chunk_size=longest, max_num_batched_tokens=longest,
        kv_cache_memory_bytes=512 << 20,
    )
    dtypes = [REFERENCE, *(dtype for dtype in args.dtypes if dtype != REFERENCE)]
    reference = LLM(default_model_path(), dtype=REFERENCE, **common)
    windows = text_windows(reference, args.text, args.windows)
    stats_path, weights_path = calibration_files(
        reference, args.text, len(windows) * WINDOW_TOKENS, args.calibration_tokens, tempfile.mkdtemp()
    )
    smoothed = {"quantization": "w8a8", "w8a8_activation_stats": stats_path}
    rotated = {"quantization": "w8a8", "w8a8_rotation": True}
    gptq = {**rotated, "w8a8_weights": weights_path}
    variants = {
        **QUANTIZATIONS, "w8a8 smoothed, ": smoothed, "w8a8 rotated, ": rotated, "w8a8 rotated gptq, ": gptq,
    }
    engine_options = {
        f"{prefix}{dtype}": {"dtype": dtype, **options, **common}
        for prefix, options in variants.items()
        for dtype in dtypes
    }
    engines = {
        name: reference if name == REFERENCE else LLM(default_model_path(), **options)
        for name, options in engine_options.items()
    }
    scores = {name: scored_positions(llm, windows) for name, llm in engines.items()}
    for llm in engines.values():
        llm.shutdown()
    print(f"Quality: {len(windows)} windows of {WINDOW_TOKENS} tokens of {args.text}")
    quality = quality_rows(scores)
    print_table(
        ["engine", "perplexity", f"ratio to {REFERENCE}", f"top-1 agreement with {REFERENCE}"], quality
    )
    samples = {name: {length: [] for length in args.lengths} for name in engine_options}
    for _ in range(args.rounds):
        for name, options in engine_options.items():
            for length, seconds in first_token_seconds_alone(options, args.lengths, args.repeats).items():
                samples[name][length] += seconds
    speed = []
    for length in args.lengths:
        medians = {name: statistics.median(by_length[length]) for name, by_length in samples.items()}
        best_float = min(medians[name] for name in engine_options if name in args.dtypes or name == REFERENCE)
        speed += [[length, name, seconds * 1e3, seconds / best_float] for name, seconds in medians.items()]
    print("\nTTFT (medians; each engine alone in a process, in turns; ratio to the fastest float engine)")
    print_table(["tokens", "engine", "TTFT ms", "ratio"], speed)
    path = save_result(
        "w8a8", {"quality": quality, "ttft": speed, "windows": len(windows), "text": args.text}
    )
    print(f"\nwritten to {path}")


if __name__ == "__main__":
    main()
