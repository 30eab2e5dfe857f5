"""The engine on each CPU class this machine can run: native kernels built for that ISA against
the plain torch ops, in the default dtype of the class, timed in turns in one process.

    python benchmarks/cpu_classes.py [--isa avx2 avx512 ...] [--dtype float32] [--repeats 5]

For each ISA given (default: every one this CPU runs, see `firsttoken.ops.cpu_isa`), and for
a baseline engine without native kernels (torch's own ops: SDPA attention, torch's quantized
matmuls), in one process and in turns:
- TTFT of fresh prompts of 128, 512 and 2048 tokens (prompt cache off);
- warm prefix: a 512-token prefix cached, 32 new tokens after it;
- decode tokens/s at batch 1 after a 512-token prompt, float weights and `quantization=int4`
  (the default model stores Q4_1: int4 decodes from the file's own levels).
Each figure is printed with its ratio to the baseline engine's. The model's weights are read
once per decode step, so decode tokens/s x weight bytes is the bandwidth decode reaches; it is
printed beside this machine's copy bandwidth (a 512 MiB tensor copied, read + write).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import first_token_run, interleaved_medians, print_table, random_prompt, save_result, timed  # noqa: E402

from firsttoken import LLM, SamplingParams  # noqa: E402
from firsttoken.models.registry import default_model_path  # noqa: E402
from firsttoken.ops.cpu_isa import runnable_cpu_isas  # noqa: E402

GREEDY_ONE = SamplingParams(temperature=0, max_tokens=1)
PREFIX_LEN, SUFFIX_LEN, DECODE_PROMPT_LEN = 512, 32, 512
BASELINE = "torch ops"


def copy_bandwidth_gb_s(megabytes: int = 512, repeats: int = 5) -> float:
    """Bytes read and written per second by a large tensor copy (the best of `repeats`)."""
    source = torch.empty(megabytes * 2**20, dtype=torch.uint8).fill_(1)
    destination = torch.empty_like(source)
    best = min(timed(lambda: destination.copy_(source)) for _ in range(repeats))
    return 2 * source.numel() / best / 1e9


def warm_prefix_run(llm: LLM):
    """A prefix cached by an untimed request, then a new suffix on it (timed)."""
    def run(index: int) -> float:
        prefix = random_prompt(PREFIX_LEN, seed=50_000 + index)
        llm.generate(
            prompt_token_ids=[prefix + random_prompt(SUFFIX_LEN, seed=1)], sampling_params=GREEDY_ONE
        )
        return ttft_of(llm, prefix + random_prompt(SUFFIX_LEN, seed=2))

    return run


def ttft_of(llm: LLM, prompt: list[int]) -> float:
    (output,) = llm.generate(prompt_token_ids=[prompt], sampling_params=GREEDY_ONE)
    return output.metrics.ttft_s


def decode_run(llm: LLM, num_tokens: int):
    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)

    def run(index: int) -> float:
        prompt = random_prompt(DECODE_PROMPT_LEN, seed=90_000 + index)
        (output,) = llm.generate(prompt_token_ids=[prompt], sampling_params=params)
        return 1.0 / output.metrics.decode_tokens_per_s

    return run


def decode_weight_bytes(llm: LLM) -> int:
    """Bytes of the weights a decode step reads: the decode form of every projection, the LM
    head, and one embedding row (negligible)."""
    model = llm.core.single_rank_model()
    seen: set[int] = set()
    total = 0
    for module in model.modules():
        decode_form = getattr(module, "quantized", None)
        if decode_form is not None:  # a DecodeQuantizedLinear: decode reads its quantized form only
            for tensor in list(decode_form.buffers()) + list(decode_form.parameters()):
                if id(tensor) not in seen:
                    seen.add(id(tensor))
                    total += tensor.numel() * tensor.element_size()
    if total:
        return total + _head_bytes(model, seen)
    return sum(
        tensor.numel() * tensor.element_size()
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers())
        if "embed" not in name
    )


def _head_bytes(model, seen: set[int]) -> int:
    head = model.lm_head
    decode_form = getattr(head, "quantized", head)
    return sum(
        tensor.numel() * tensor.element_size()
        for tensor in list(decode_form.buffers()) + list(decode_form.parameters())
        if id(tensor) not in seen
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--isa", nargs="+", default=None, help="ISAs to build for (default: every one this CPU runs)"
    )
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--decode-tokens", type=int, default=32)
    args = parser.parse_args()
    isas = args.isa or runnable_cpu_isas()
    path = default_model_path()
    max_len = max(max(args.lengths), PREFIX_LEN + SUFFIX_LEN, DECODE_PROMPT_LEN + args.decode_tokens)
    options = dict(dtype=args.dtype, chunk_size=max_len, max_num_batched_tokens=max_len,
                   kv_cache_memory_bytes=1 << 30)
    settings = {BASELINE: dict(native_kernels=False), **{isa: dict(cpu_isa=isa) for isa in isas}}
    started = time.perf_counter()
    cold = {
        name: LLM(path, enable_prompt_cache=False, **options, **extra) for name, extra in settings.items()
    }
    warm = {name: LLM(path, enable_prompt_cache=True, **options, **extra) for name, extra in settings.items()}
    int4 = {name: LLM(path, enable_prompt_cache=False, quantization="int4", **options, **extra)
            for name, extra in settings.items()}
    print(f"{len(settings) * 3} engines loaded in {time.perf_counter() - started:.0f} s; "
          f"{torch.get_num_threads()} threads; native kernels built for "
          + ", ".join(f"{isa} -> {cold[isa].inspect().native_isa}" for isa in isas))

    results: dict[str, dict[str, float]] = {}
    for length in args.lengths:
        medians = interleaved_medians(
            {name: first_token_run(llm, length, GREEDY_ONE, 1_000 * length) for name, llm in cold.items()},
            args.repeats,
        )
        results[f"TTFT {length} tokens (ms)"] = {name: seconds * 1000 for name, seconds in medians.items()}
    medians = interleaved_medians({name: warm_prefix_run(llm) for name, llm in warm.items()}, args.repeats)
    results[f"warm prefix {PREFIX_LEN} + {SUFFIX_LEN} (ms)"] = {name: s * 1000 for name, s in medians.items()}
    for label, engines in (
        (f"decode {args.dtype}, batch 1 (tok/s)", cold),
        ("decode int4, batch 1 (tok/s)", int4),
    ):
        medians = interleaved_medians(
            {name: decode_run(llm, args.decode_tokens) for name, llm in engines.items()}, args.repeats
        )
        results[label] = {name: 1.0 / seconds for name, seconds in medians.items()}

    names = list(settings)
    print_table(
        ["measure", *names, *[f"{isa} / {BASELINE}" for isa in isas]],
        [[label, *[row[name] for name in names], *[row[isa] / row[BASELINE] for isa in isas]]
         for label, row in results.items()],
    )
    bandwidth = copy_bandwidth_gb_s()
    rows = []
    for label, engines in ((f"{args.dtype}", cold), ("int4", int4)):
        for name, llm in engines.items():
            rate = results[f"decode {label}, batch 1 (tok/s)"][name]
            weight_bytes = decode_weight_bytes(llm)
            reached = rate * weight_bytes / 1e9
            rows.append([f"{label}, {name}", weight_bytes / 2**20, rate, reached, reached / bandwidth])
    print(f"copy bandwidth (read + write of 512 MiB): {bandwidth:.1f} GB/s")
    print_table(
        ["decode weights", "MiB read a step", "tok/s", "GB/s read", "fraction of copy bandwidth"], rows
    )
    print("saved", save_result("cpu_classes", {"isas": isas, "dtype": args.dtype, "results": results,
                                                "copy_bandwidth_gb_s": bandwidth}))


if __name__ == "__main__":
    main()
