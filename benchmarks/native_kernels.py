"""The hand-written CPU kernels against the torch ops they replace, in one process, in turns.

    python benchmarks/native_kernels.py [--lengths 16 128 512 2048] [--repeats 5] [--decode-tokens 64]
        [--dtype auto]

1. Each kernel alone (bf16, SmolLM2-135M's shapes): add+RMSNorm, SwiGLU and rotary against
   the same op compiled by inductor and in eager torch; causal prefill attention (9 query
   heads, 3 KV heads, head size 64) against SDPA's flash kernel; a decode step's attention (48
   sequences over a paged cache in scattered blocks of 16) with the prefill kernel's arithmetic
   (the batch-invariant default) and with the exact kernel; greedy sampling's argmax over rows of
   49152 float32 logits against torch.argmax. Medians of 30 calls in turns.
2. Two engines that differ only in `native_kernels`, in `--dtype` (`auto`: what an engine
   picks here, bf16 where the CPU multiplies bf16 natively, float32 elsewhere): on, norms,
   rotary, SwiGLU and the KV write are C kernels and prefill attention is ours; off, the same
   steps are torch ops (inductor-compiled from 512 tokens, SDPA's flash kernel). TTFT per
   prompt length and decode tokens/s after a 512-token prompt (float and int4 weights), as
   medians and ratios on / off.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    engine_dtype_name,
    first_token_run,
    interleaved_medians,
    print_table,
    random_prompt,
    save_result,
)

from firsttoken import LLM, SamplingParams  # noqa: E402
from firsttoken.models.loaders.conversion_cache import default_cache_dir  # noqa: E402
from firsttoken.models.registry import default_model_path  # noqa: E402
from firsttoken.ops import kernels  # noqa: E402
from firsttoken.ops.native import NativeKernels, load_native_kernels  # noqa: E402
from firsttoken.ops.rotary import cos_sin_table, inverse_frequencies, rotary_cos_sin  # noqa: E402

GREEDY_ONE = SamplingParams(temperature=0, max_tokens=1)
DECODE_PROMPT_LEN = 512
SETTINGS = {"native kernels": True, "torch ops": False}


KERNEL_ROWS = [64, 512, 2048]
ATTENTION_LENGTHS = [128, 512, 2048]
# A saturated decode step's sequences and their contexts (a 512-token prompt's first and last
# decode steps of 64, and a short chat's).
DECODE_ATTENTION_ROWS = 48
DECODE_CONTEXTS = [100, 512, 576]
DECODE_BLOCK_SIZE = 16
# A decode step's sampled rows, one to a full batch; SmolLM2's vocabulary.
ARGMAX_ROWS = [1, 8, 48]
VOCAB_SIZE = 49152


def call_medians(calls: dict[str, object], repeats: int = 30) -> dict[str, float]:
    """Median microseconds of each call, taking turns."""
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for index in range(-2, repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            if index >= 0:
                samples[name].append((time.perf_counter() - start) * 1e6)
    return {name: statistics.median(values) for name, values in samples.items()}


def kernel_rows(native: NativeKernels) -> list[list[object]]:
    rows = []
    table = cos_sin_table(inverse_frequencies(64, 10000.0, None, None), 4096)
    for num_rows in KERNEL_ROWS:
        x, residual = (torch.randn(num_rows, 576).to(torch.bfloat16) for _ in range(2))
        weight = torch.randn(576).to(torch.bfloat16)
        gate_up = torch.randn(num_rows, 2 * 1536).to(torch.bfloat16)
        cos, sin = rotary_cos_sin(table, torch.randint(0, 4096, (num_rows,)), torch.bfloat16)
        query_key = torch.randn(num_rows, 15 * 64).to(torch.bfloat16)[:, : 12 * 64].view(num_rows, 12, 64)
        ops = {
            "add+RMSNorm": (lambda: native.rows.add_rms_norm(x, residual, weight, 1e-5),
                            lambda: kernels._fused_add_rms_norm(x, residual, weight, 1e-5),
                            lambda: kernels.add_rms_norm_reference(x, residual, weight, 1e-5)),
            "SwiGLU": (lambda: native.rows.silu_and_mul(gate_up),
                       lambda: kernels._fused_silu_and_mul(gate_up),
                       lambda: kernels.silu_and_mul_reference(gate_up)),
            "rotary": (lambda: native.rows.apply_rotary_(query_key, cos, sin),
                       lambda: kernels._fused_apply_rotary(query_key, cos, sin),
                       lambda: kernels.apply_rotary_reference(query_key, cos, sin)),
        }
        for op, (native_call, compiled_call, eager_call) in ops.items():
            us = call_medians({"native": native_call, "compiled": compiled_call, "eager": eager_call})
            rows.append(
                [op, num_rows, us["native"], us["compiled"], us["eager"], us["native"] / us["compiled"]]
            )
    return rows


def attention_rows(native: NativeKernels) -> list[list[object]]:
    rows = []
    for length in ATTENTION_LENGTHS:
        query = torch.randn(length, 9, 64).to(torch.bfloat16)
        key, value = (torch.randn(length, 3, 64).to(torch.bfloat16) for _ in range(2))
        us = call_medians({
            "native": lambda: native.attention.prefill_attention(query, key, value, torch.get_num_threads()),
            "sdpa": lambda: F.scaled_dot_product_attention(
                query.transpose(0, 1)[None], key.transpose(0, 1)[None], value.transpose(0, 1)[None],
                is_causal=True, enable_gqa=True,
            ),
        })
        flops = 4 * 9 * 64 * length * (length + 1) / 2
        rows.append([length, us["native"], us["sdpa"], flops / us["native"] / 1e3, flops / us["sdpa"] / 1e3,
                     us["native"] / us["sdpa"]])
    return rows


def decode_attention_rows(native: NativeKernels) -> list[list[object]]:
    """Per context: microseconds of one layer's decode attention as the prefill's arithmetic and
    as the exact kernel, and the ratio."""
    rows = []
    generator = torch.Generator().manual_seed(0)
    for context in DECODE_CONTEXTS:
        blocks_per_sequence = -(-(context + 1) // DECODE_BLOCK_SIZE)
        num_blocks = DECODE_ATTENTION_ROWS * blocks_per_sequence
        kv_cache = torch.randn(2, num_blocks, DECODE_BLOCK_SIZE, 3, 64, generator=generator).bfloat16()
        block_table = torch.randperm(num_blocks, generator=generator).view(DECODE_ATTENTION_ROWS, -1)
        seq_lens = torch.full((DECODE_ATTENTION_ROWS,), context + 1)
        query = torch.randn(DECODE_ATTENTION_ROWS, 9, 64, generator=generator).to(torch.bfloat16)
        us = call_medians({
            "as prefill": lambda: native.attention.paged_decode_attention(
                query, kv_cache, block_table, seq_lens, True
            ),
            "exact": lambda: native.attention.paged_decode_attention(
                query, kv_cache, block_table, seq_lens, False
            ),
        })
        rows.append([context, us["as prefill"], us["exact"], us["as prefill"] / us["exact"]])
    return rows


def argmax_rows(native: NativeKernels) -> list[list[object]]:
    rows = []
    for num_rows in ARGMAX_ROWS:
        logits = torch.randn(num_rows, VOCAB_SIZE)
        us = call_medians({
            "native": lambda: native.rows.argmax_rows(logits), "torch": lambda: torch.argmax(logits, dim=-1)
        })
        rows.append([num_rows, us["native"], us["torch"], us["native"] / us["torch"]])
    return rows


def print_kernel_tables(native: NativeKernels) -> None:
    print_table(
        ["op (bf16)", "rows", "native us", "compiled us", "eager us", "native / compiled"],
        kernel_rows(native),
    )
    if native.attention.has_prefill_attention:
        form = "AMX" if native.has_amx else "AVX512-BF16"
        print()
        print_table(
            [
                "causal prefill tokens",
                f"native ({form}) us",
                "SDPA us",
                "native GFLOP/s",
                "SDPA GFLOP/s",
                "ratio",
            ],
            attention_rows(native),
        )
    if native.has_decode_kernels:
        print()
        print_table(
            [f"decode context ({DECODE_ATTENTION_ROWS} rows)", "as prefill us", "exact us", "ratio"],
            decode_attention_rows(native),
        )
    print()
    print_table(["argmax rows", "native us", "torch us", "native / torch"], argmax_rows(native))
    print()


def decode_run(llm: LLM, num_tokens: int):
    """Seconds per generated token after the first (the decode steps only)."""
    params = SamplingParams(temperature=0, max_tokens=num_tokens + 1, ignore_eos=True)

    def run(index: int) -> float:
        prompt = random_prompt(DECODE_PROMPT_LEN, seed=9_500 + index)
        metrics = llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0].metrics
        return (metrics.last_token_time - metrics.first_token_time) / num_tokens

    return run


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lengths", type=int, nargs="+", default=[16, 128, 512, 2048])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    args = parser.parse_args()
    native = load_native_kernels(os.path.join(default_cache_dir(), "native"))
    if native is None:
        sys.exit("no native kernels on this machine (no working C compiler): nothing to compare")
    print_kernel_tables(native)
    path = default_model_path()
    max_len = max(max(args.lengths), DECODE_PROMPT_LEN + args.decode_tokens + 1)
    options = dict(
        dtype=args.dtype, enable_prompt_cache=False, chunk_size=max_len, max_num_batched_tokens=max_len
    )
    engines = {name: LLM(path, native_kernels=on, **options) for name, on in SETTINGS.items()}
    int4_engines = {
        name: LLM(path, native_kernels=on, quantization="int4", **options) for name, on in SETTINGS.items()
    }
    on, off = SETTINGS

    rows, ttft_results = [], {}
    for length in args.lengths:
        ttft = interleaved_medians(
            {
                name: first_token_run(llm, length, GREEDY_ONE, 9_000 + 10 * length)
                for name, llm in engines.items()
            },
            args.repeats,
        )
        ttft_results[length] = ttft
        rows.append([length, ttft[on] * 1000, ttft[off] * 1000, ttft[on] / ttft[off]])
    print_table(["prompt tokens", f"TTFT ms, {on}", f"TTFT ms, {off}", "ratio"], rows)

    rows, decode_results = [], {}
    for weights, group in ((engine_dtype_name(engines[on]), engines), ("int4", int4_engines)):
        per_token = interleaved_medians(
            {name: decode_run(llm, args.decode_tokens) for name, llm in group.items()}, args.repeats
        )
        decode_results[weights] = per_token
        rows.append([weights, 1 / per_token[on], 1 / per_token[off], per_token[off] / per_token[on]])
    print()
    print_table(
        [f"decode after {DECODE_PROMPT_LEN} tokens", f"tokens/s, {on}", f"tokens/s, {off}", "speed-up"], rows
    )
    print(
        "saved", save_result("native_kernels", {"ttft_s": ttft_results, "decode_s_per_token": decode_results})
    )


if __name__ == "__main__":
    main()
