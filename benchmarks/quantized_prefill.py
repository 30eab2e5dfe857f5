"""TTFT of quantized engines against bf16: prefill on the float weights (default) or on the
quantized ones (`quantized_prefill=True`), one prompt length, all engines timed in turns.

    python benchmarks/quantized_prefill.py [--length 512] [--repeats 5]

The quantized CPU kernels are built for steps of a few rows; a prefill on them pays for it.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import first_token_run, interleaved_medians, print_table, save_result  # noqa: E402

from firsttoken import LLM, SamplingParams  # noqa: E402
from firsttoken.models.registry import default_model_path  # noqa: E402

GREEDY_ONE = SamplingParams(temperature=0, max_tokens=1)
BASELINE = "bf16, no quantization"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    path = default_model_path()
    options = dict(
        dtype="bfloat16",
        enable_prompt_cache=False,
        chunk_size=args.length,
        max_num_batched_tokens=args.length,
    )
    engines = {BASELINE: LLM(path, **options)}
    for quantization in ("int4", "int8"):
        for quantized_prefill in (False, True):
            weights = "quantized" if quantized_prefill else "float"
            engines[f"{quantization}, prefill on {weights} weights"] = LLM(
                path, quantization=quantization, quantized_prefill=quantized_prefill, **options
            )
    ttft = interleaved_medians(
        {name: first_token_run(llm, args.length, GREEDY_ONE, 5_000) for name, llm in engines.items()},
        args.repeats,
    )
    print_table(
        [f"engine ({args.length}-token prompt)", "TTFT ms", f"ratio vs {BASELINE}"],
        [[name, seconds * 1000, seconds / ttft[BASELINE]] for name, seconds in ttft.items()],
    )
    print("saved", save_result("quantized_prefill", {"length": args.length, "ttft_s": ttft}))


if __name__ == "__main__":
    main()
