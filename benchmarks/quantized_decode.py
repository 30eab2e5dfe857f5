"""Quantized decode on this CPU: the projections' kernels, then whole engines, in turns.

    python benchmarks/quantized_decode.py [--isa auto] [--repeats 7] [--threads N]
                                     [--skip-kernels] [--skip-engines]

1. Memory bandwidth: the median of summing a 1 GiB float32 tensor (reads only), GB/s.
2. Kernels: every projection of SmolLM2-135M's 30 layers (576 -> 960 qkv, 576 -> 576 o,
   576 -> 3072 gate/up, 1536 -> 576 down; distinct weights, so each call streams its weights
   from memory as a decode step does) at 1, 4 and 8 rows: float32 F.linear, torch's
   `_weight_int4pack_mm_for_cpu` and `_weight_int8pack_mm` (float32 and bf16 activations) and
   the portable kernels (csrc/quantized_matmul.c, built for `--isa`). Medians in turns, ratios
   against float32 F.linear, and the GB/s each int4/int8 kernel reads its weights at.
3. Engines: decode tokens/s of `LLM(dtype="float32", quantization="int4")` against float32
   without quantization, batch 1 and 8 after a 64-token prompt; medians in turns, ratios, and
   the fraction of the measured bandwidth the int4 decode's weight bytes reach.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import interleaved_medians, print_table, random_prompt, save_result, timed  # noqa: E402

from firsttoken import LLM, SamplingParams  # noqa: E402
from firsttoken.config import CPU_ISAS  # noqa: E402
from firsttoken.models.loaders.conversion_cache import default_cache_dir  # noqa: E402
from firsttoken.models.registry import default_model_path  # noqa: E402
from firsttoken.ops.native import NativeKernels, load_native_kernels  # noqa: E402
from firsttoken.ops.native_abi import INT4_GROUP_SIZE  # noqa: E402
from firsttoken.ops.quantized_linear import pack_int4, quantize_int4  # noqa: E402
from firsttoken.ops.w8a8 import quantize_int8  # noqa: E402

# (in_features, out_features) of one SmolLM2-135M layer's fused projections.
LAYER_SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]
NUM_LAYERS = 30
ROW_COUNTS = (1, 4, 8)
BANDWIDTH_BYTES = 1 << 30
BASELINE = "float32 F.linear"
DECODE_PROMPT_LEN = 64
DECODE_TOKENS = 32


def measured_bandwidth(repeats: int) -> float:
    """Bytes per second a sum over a tensor far larger than the caches reads at."""
    data = torch.ones(BANDWIDTH_BYTES // 4)
    seconds = interleaved_medians({"sum": lambda index: timed(lambda: data.sum())}, repeats)["sum"]
    return BANDWIDTH_BYTES / seconds


class LayerWeights:
    """One layer's projections in every form the kernels take."""

    def __init__(self, in_features: int, out_features: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.float32 = torch.randn(out_features, in_features, generator=generator) * 0.05
        levels, scales_and_zeros = quantize_int4(self.float32)
        self.torch_int4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(levels, 1)
        self.torch_int4_scales = {
            dtype: scales_and_zeros.to(dtype) for dtype in (torch.float32, torch.bfloat16)
        }
        self.levels, self.scales_zeros = pack_int4(levels, scales_and_zeros)
        self.int8, scales = quantize_int8(self.float32)
        self.int8_scales = {torch.float32: scales, torch.bfloat16: scales.to(torch.bfloat16)}

    def int4_bytes(self) -> int:
        return self.levels.nbytes + self.scales_zeros.nbytes

    def int8_bytes(self) -> int:
        return self.int8.nbytes + self.int8_scales[torch.float32].nbytes


def projection_runs(
    weights: list[LayerWeights], native: NativeKernels | None, rows: int
) -> dict[str, Callable]:
    """name -> a function running every projection once on `rows` rows."""
    inputs = {
        dtype: {w.float32.shape[1]: torch.randn(rows, w.float32.shape[1]).to(dtype) for w in weights}
        for dtype in (torch.float32, torch.bfloat16)
    }

    def over_layers(
        project: Callable[[LayerWeights, torch.Tensor], torch.Tensor], dtype: torch.dtype
    ) -> Callable:
        return lambda: [project(w, inputs[dtype][w.float32.shape[1]]) for w in weights]

    runs = {BASELINE: over_layers(lambda w, x: F.linear(x, w.float32), torch.float32)}
    for dtype, label in ((torch.float32, "float32"), (torch.bfloat16, "bf16")):
        runs[f"torch int4, {label} x"] = over_layers(
            lambda w, x, dtype=dtype: torch.ops.aten._weight_int4pack_mm_for_cpu(
                x, w.torch_int4, INT4_GROUP_SIZE, w.torch_int4_scales[dtype]
            ),
            dtype,
        )
        runs[f"torch int8, {label} x"] = over_layers(
            lambda w, x, dtype=dtype: torch.ops.aten._weight_int8pack_mm(x, w.int8, w.int8_scales[dtype]),
            dtype,
        )
        if native is not None:
            runs[f"portable int4, {label} x"] = over_layers(
                lambda w, x: native.quantized.portable_int4_matmul(w.levels, w.scales_zeros, None, x), dtype
            )
            runs[f"portable int8, {label} x"] = over_layers(
                lambda w, x, dtype=dtype: native.quantized.portable_int8_matmul(
                    w.int8, w.int8_scales[dtype], None, x
                ),
                dtype,
            )
    return runs


def bench_kernels(native: NativeKernels | None, repeats: int) -> dict:
    weights = [
        LayerWeights(i, o, seed=layer * 4 + k)
        for layer in range(NUM_LAYERS)
        for k, (i, o) in enumerate(LAYER_SHAPES)
    ]
    int4_bytes = sum(w.int4_bytes() for w in weights)
    int8_bytes = sum(w.int8_bytes() for w in weights)
    results = {}
    for rows in ROW_COUNTS:
        runs = projection_runs(weights, native, rows)
        medians = interleaved_medians(
            {name: (lambda index, run=run: timed(run)) for name, run in runs.items()}, repeats
        )
        table = []
        for name, seconds in medians.items():
            read = int4_bytes if "int4" in name else int8_bytes if "int8" in name else None
            gigabytes_per_second = read / seconds / 1e9 if read else float("nan")
            table.append([name, seconds * 1000, seconds / medians[BASELINE], gigabytes_per_second])
        print_table([f"{rows} rows: 120 projections", "ms", f"ratio vs {BASELINE}", "weights GB/s"], table)
        results[rows] = medians
    return results


def decode_seconds_per_token(llm: LLM, batch: int, index: int) -> float:
    """Seconds per decode step of `batch` requests, their prefill's time taken out."""
    prompts = [random_prompt(DECODE_PROMPT_LEN, seed=90_000 + 100 * index + b) for b in range(batch)]
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    many = SamplingParams(temperature=0, max_tokens=DECODE_TOKENS + 1, ignore_eos=True)
    prefill = timed(lambda: llm.generate(prompt_token_ids=prompts, sampling_params=one))
    whole = timed(lambda: llm.generate(prompt_token_ids=prompts, sampling_params=many))
    return (whole - prefill) / DECODE_TOKENS


def decode_weight_bytes(llm: LLM) -> int:
    """Bytes of the weights a quantized decode step reads: every quantized projection's
    buffers (the layers' int4 and the LM head's int8)."""
    model = llm.core.single_rank_model()
    quantized = [module.quantized for module in model.modules() if hasattr(module, "quantized")]
    return sum(buffer.nbytes for module in quantized for buffer in module.buffers())


def bench_engines(isa: str, repeats: int, bandwidth: float) -> dict:
    path = default_model_path()
    options = dict(dtype="float32", enable_prompt_cache=False, cpu_isa=isa, kv_cache_memory_bytes=512 << 20)
    engines = {"float32": LLM(path, **options), "float32 + int4": LLM(path, quantization="int4", **options)}
    results = {}
    for batch in (1, 8):
        runs = {
            name: (lambda index, llm=llm: decode_seconds_per_token(llm, batch, index))
            for name, llm in engines.items()
        }
        medians = interleaved_medians(runs, repeats)
        print_table(
            [f"decode, batch {batch}", "ms/step", "tokens/s", "ratio vs float32"],
            [[name, s * 1000, batch / s, medians["float32"] / s] for name, s in medians.items()],
        )
        results[batch] = medians
    step_bytes = decode_weight_bytes(engines["float32 + int4"])
    fraction = step_bytes / results[1]["float32 + int4"] / bandwidth
    print(
        f"int4 decode, batch 1: {step_bytes / 1e6:.1f} MB of weights a step, "
        f"{fraction:.0%} of the measured bandwidth"
    )
    return {
        "decode_s_per_step": results,
        "int4_step_weight_bytes": step_bytes,
        "bandwidth_fraction": fraction,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--isa", choices=CPU_ISAS, default="auto", help="the native kernels' build target")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    parser.add_argument("--skip-kernels", action="store_true")
    parser.add_argument("--skip-engines", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    native = load_native_kernels(os.path.join(default_cache_dir(), "native"), args.isa)
    print(f"native kernels: {native.isa if native else 'none'}; torch threads: {torch.get_num_threads()}")
    bandwidth = measured_bandwidth(args.repeats)
    print(f"memory bandwidth (sum over {BANDWIDTH_BYTES >> 20} MiB): {bandwidth / 1e9:.1f} GB/s")
    result = {"isa": native.isa if native else None, "bandwidth_bytes_per_s": bandwidth}
    if not args.skip_kernels:
        result["kernels_s"] = bench_kernels(native, args.repeats)
    if not args.skip_engines:
        result["engines"] = bench_engines(args.isa, args.repeats, bandwidth)
    print("saved", save_result("quantized_decode", result))


if __name__ == "__main__":
    main()
