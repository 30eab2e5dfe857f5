"""The row-invariant float32 matmul against torch's F.linear, in one process, in turns.

    python benchmarks/row_invariant_matmul.py [--isa avx2 ...] [--rows 1 8 128 512 2048] [--repeats 15]
                                         [--lengths 128 512] [--engine-repeats 5] [--decode-tokens 32]
                                         [--threads N] [--skip-engine]

1. The kernel alone on SmolLM2-135M's projections (fused QKV 960x576 = q 576 + k, v 192 each,
   o 576x576, fused gate/up 3072x576, down 576x1536, LM head 49152x576), float32 weights,
   bf16-stored ones (widened in registers) and, for steps of up to 8 rows, the weights' GGUF
   levels (the same bits), against F.linear in float32: median milliseconds of calls taken in
   turns, and ratios (ours / torch; below 1 is faster). The weights are random values on the
   embedded model's grids (Q4_1 blocks, the LM head Q8_0). `--isa`: each build this CPU can
   run (default: all of them).
2. Two float32 engines that differ only in `batch_invariant` (on: every projection and the
   LM head on the kernel; off: torch's F.linear): TTFT per prompt length and decode
   tokens/s after a 128-token prompt, medians in turns, ratios on / off.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import first_token_run, interleaved_medians, print_table, random_prompt, save_result  # noqa: E402

from firsttoken import LLM, SamplingParams  # noqa: E402
from firsttoken.models.loaders.conversion_cache import default_cache_dir  # noqa: E402
from firsttoken.models.registry import default_model_path  # noqa: E402
from firsttoken.ops.cpu_isa import runnable_cpu_isas  # noqa: E402
from firsttoken.ops.native import NativeKernels, load_native_kernels  # noqa: E402
from firsttoken.ops.native_abi import LEVELS_MAX_ROWS  # noqa: E402
from firsttoken.ops.weight_levels import pack_levels  # noqa: E402

# (name, out_features, in_features)
SHAPES = [
    ("qkv", 960, 576),
    ("o", 576, 576),
    ("gate_up", 3072, 576),
    ("down", 576, 1536),
    ("lm_head", 49152, 576),
]
# The LM head only sees the rows that sample: at most a batch of decodes.
LM_HEAD_MAX_ROWS = 128
DECODE_PROMPT_LEN = 128
GREEDY_ONE = SamplingParams(temperature=0, max_tokens=1)


def call_medians(calls: dict[str, object], repeats: int) -> dict[str, float]:
    """Median milliseconds of each call, taking turns."""
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for index in range(-2, repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            if index >= 0:
                samples[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(values) for name, values in samples.items()}


def kernel_rows(native: NativeKernels, row_counts: list[int], repeats: int) -> list[list[object]]:
    table = []
    for name, out_features, in_features in SHAPES:
        blocks = GGMLQuantizationType.Q8_0 if name == "lm_head" else GGMLQuantizationType.Q4_1
        values = (torch.randn(out_features, in_features) / in_features**0.5).numpy()
        weight = torch.from_numpy(dequantize(quantize(values, blocks), blocks).astype("float32"))
        packed = native.matmul.pack_matmul_weight(weight)
        packed_bf16 = native.matmul.pack_matmul_weight(weight, torch.bfloat16)
        packed_levels = pack_levels(native.matmul.find_levels(weight), native.matmul.matmul_panel_width)
        for rows in row_counts:
            if name == "lm_head" and rows > LM_HEAD_MAX_ROWS:
                continue
            x = torch.randn(rows, in_features)
            # Fewer turns where one call is long: the ratio, not the count, is what is read.
            turns = max(3, min(repeats, int(repeats * 2e8 / (2 * rows * out_features * in_features))))
            calls = {
                "ours": lambda: native.matmul.row_invariant_matmul(x, packed, None, out_features),
                "ours bf16 W": lambda: native.matmul.row_invariant_matmul(x, packed_bf16, None, out_features),
                "torch": lambda: F.linear(x, weight),
            }
            if rows <= LEVELS_MAX_ROWS:
                calls["ours levels"] = lambda: native.matmul.row_invariant_levels_matmul(
                    x, packed_levels, None, out_features
                )
            ms = call_medians(calls, turns)
            levels_ms = ms.get("ours levels")
            gflops = 2 * rows * out_features * in_features / ms["ours"] / 1e6
            table.append(
                [
                    native.isa,
                    name,
                    rows,
                    ms["ours"],
                    ms["ours bf16 W"],
                    ms["torch"],
                    gflops,
                    ms["ours"] / ms["torch"],
                    ms["ours bf16 W"] / ms["torch"],
                    "-" if levels_ms is None else levels_ms / ms["torch"],
                ]
            )
    return table


def decode_run(llm: LLM, num_tokens: int):
    """Seconds per generated token after the first (the decode steps only)."""
    params = SamplingParams(temperature=0, max_tokens=num_tokens + 1, ignore_eos=True)

    def run(index: int) -> float:
        prompt = random_prompt(DECODE_PROMPT_LEN, seed=7_500 + index)
        metrics = llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0].metrics
        return (metrics.last_token_time - metrics.first_token_time) / num_tokens

    return run


def engine_tables(isa: str, lengths: list[int], repeats: int, decode_tokens: int) -> dict:
    max_len = max(*lengths, DECODE_PROMPT_LEN + decode_tokens + 1)
    options = dict(
        dtype="float32",
        enable_prompt_cache=False,
        chunk_size=max_len,
        max_num_batched_tokens=max_len,
        cpu_isa=isa,
        num_threads=torch.get_num_threads(),
    )
    engines = {
        setting: LLM(default_model_path(), batch_invariant=setting == "on", **options)
        for setting in ("on", "off")
    }
    rows, ttft_results = [], {}
    for length in lengths:
        ttft = interleaved_medians(
            {
                name: first_token_run(llm, length, GREEDY_ONE, 7_000 + 10 * length)
                for name, llm in engines.items()
            },
            repeats,
        )
        ttft_results[length] = ttft
        rows.append([isa, length, ttft["on"] * 1000, ttft["off"] * 1000, ttft["on"] / ttft["off"]])
    print_table(["isa", "prompt tokens", "TTFT ms, invariant", "TTFT ms, torch", "ratio"], rows)
    per_token = interleaved_medians(
        {name: decode_run(llm, decode_tokens) for name, llm in engines.items()}, repeats
    )
    print()
    print_table(
        ["isa", f"decode after {DECODE_PROMPT_LEN}", "tokens/s, invariant", "tokens/s, torch", "ratio"],
        [[isa, "batch 1", 1 / per_token["on"], 1 / per_token["off"], per_token["on"] / per_token["off"]]],
    )
    return {"ttft_s": ttft_results, "decode_s_per_token": per_token}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--isa", nargs="+", default=runnable_cpu_isas() or ["auto"])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 128, 512, 2048])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--engine-repeats", type=int, default=5)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--skip-engine", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch threads: {torch.get_num_threads()}")
    results = {}
    for isa in args.isa:
        native = load_native_kernels(os.path.join(default_cache_dir(), "native"), isa)
        if native is None:
            sys.exit("no native kernels on this machine (no working C compiler): nothing to compare")
        table = kernel_rows(native, args.rows, args.repeats)
        print_table(
            [
                "isa",
                "projection",
                "rows",
                "ours ms",
                "ours bf16 W ms",
                "torch ms",
                "ours GFLOP/s",
                "ratio",
                "ratio bf16 W",
                "ratio levels",
            ],
            table,
        )
        print()
        results[isa] = {"kernel": table}
        if not args.skip_engine:
            results[isa]["engine"] = engine_tables(isa, args.lengths, args.engine_repeats, args.decode_tokens)
            print()
    print("saved", save_result("row_invariant_matmul", results))


if __name__ == "__main__":
    main()
