"""W8A8's int8 product for every projection of SmolLM2-135M's 30 layers: oneDNN's int8 matmul
followed by the native pass that scales and rounds its float32 rows, against the native int8
matmul that scales and rounds in registers (VPDPBUSD where the build has AVX512-VNNI, else
VPMADDWD; and on AMX-INT8 tiles, timed beside VNNI, where the build has them), timed in turns.
All give the same bits.

    python benchmarks/w8a8_matmul.py [--rows 512 2048] [--repeats 5] [--isa auto]

oneDNN's side needs exact int8 sums (VNNI or AMX-INT8); elsewhere only the native one runs.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import interleaved_medians, print_table, save_result, timed  # noqa: E402

from firsttoken.ops import native  # noqa: E402
from firsttoken.ops.w8a8 import (  # noqa: E402
    ACTIVATION_ZERO_POINT,
    no_zero_points,
    onednn_int8_matmul,
    onednn_int8_sums_exact,
    quantize_int8,
)

# SmolLM2-135M's projections (in_features, out_features): q|k|v, o, gate|up, down.
PROJECTIONS = [(576, 960), (576, 576), (576, 3072), (1536, 576)]
NUM_LAYERS = 30


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--isa", default="auto")
    args = parser.parse_args()
    kernels = native.load_native_kernels(tempfile.mkdtemp(), args.isa)
    if kernels is None or not kernels.w8a8.has_w8a8_matmul:
        sys.exit(f"the {args.isa} build has no native int8 matmul (x86 with AVX2 only)")
    instructions = "AVX512-VNNI" if kernels.w8a8.w8a8_matmul_uses_vnni else "AVX2"
    generator = torch.Generator().manual_seed(0)
    on_onednn = onednn_int8_sums_exact()
    layers = []
    for _ in range(NUM_LAYERS):
        for in_features, out_features in PROJECTIONS:
            levels, scales = quantize_int8(torch.randn(out_features, in_features, generator=generator))
            onednn_weight = torch.ops.onednn.qlinear_prepack(levels, None) if on_onednn else None
            layers.append((in_features, onednn_weight, kernels.w8a8.pack_w8a8_weight(levels), scales))
    results = []
    for rows in args.rows:
        inputs = {
            width: kernels.w8a8.quantize_rows_int8(torch.randn(rows, width, generator=generator).bfloat16())
            for width in {in_features for in_features, _ in PROJECTIONS}
        }

        def onednn_then_rescale() -> None:
            for in_features, onednn_weight, _, scales in layers:
                levels, row_scales = inputs[in_features]
                sums = onednn_int8_matmul(
                    levels, onednn_weight, scales, no_zero_points(scales.shape[0]), ACTIVATION_ZERO_POINT
                )
                kernels.rows.rescale_rows(sums, row_scales, None, torch.bfloat16)

        def native_matmul(use_amx: bool) -> None:
            for in_features, _, packed, scales in layers:
                levels, row_scales = inputs[in_features]
                kernels.w8a8.w8a8_matmul(
                    levels, row_scales, packed, scales, None, torch.bfloat16, use_amx=use_amx
                )

        runs = {f"native int8 matmul ({instructions})": lambda index: timed(lambda: native_matmul(False))}
        if kernels.w8a8.w8a8_matmul_uses_amx:
            runs["native int8 matmul (AMX-INT8)"] = lambda index: timed(lambda: native_matmul(True))
        if on_onednn:
            runs["oneDNN int8 matmul + rescale pass"] = lambda index: timed(onednn_then_rescale)
        medians = interleaved_medians(runs, args.repeats)
        operations = 2 * rows * NUM_LAYERS * sum(i * o for i, o in PROJECTIONS)
        fastest = min(medians.values())
        results += [
            [rows, name, seconds * 1e3, operations / seconds / 1e9, seconds / fastest]
            for name, seconds in medians.items()
        ]
    print(f"{NUM_LAYERS} layers of SmolLM2-135M's projections, bf16 out, {torch.get_num_threads()} threads")
    print_table(["rows", "product", "ms", "GOP/s", "ratio"], results)
    print(f"\nwritten to {save_result('w8a8_matmul', {'results': results, 'isa': kernels.isa})}")


if __name__ == "__main__":
    main()
