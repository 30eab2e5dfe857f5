"""TTFT of firsttoken and of transformers on the same weights, in one run, with ratios.

    python benchmarks/ttft_vs_transformers.py [--lengths 128 512 2048] [--repeats 5] [--dtype float32]

TTFT here is the wall time from handing over the prompt's token ids to holding the first
generated token: firsttoken's `LLM.generate(max_tokens=1)` with the prompt cache off, and
transformers' `generate(max_new_tokens=1)`. Each prompt is fresh random tokens.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import interleaved_medians, print_table, random_prompt, save_result, timed  # noqa: E402

from firsttoken import LLM, SamplingParams  # noqa: E402
from firsttoken.models.registry import default_model_path  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    torch_dtype = getattr(torch, args.dtype)
    path = default_model_path()
    max_len = max(args.lengths)
    llm = LLM(
        path, dtype=args.dtype, enable_prompt_cache=False, chunk_size=max_len, max_num_batched_tokens=max_len
    )
    folder, file_name = os.path.split(path)
    hf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file_name, dtype=torch_dtype).eval()
    greedy_one = SamplingParams(temperature=0, max_tokens=1)

    rows, results = [], []
    for length in args.lengths:
        def ours(run: int) -> float:
            prompt = random_prompt(length, seed=1000 * length + run)
            return timed(lambda: llm.generate(prompt_token_ids=[prompt], sampling_params=greedy_one))

        def theirs(run: int) -> float:
            prompt = torch.tensor([random_prompt(length, seed=1000 * length + run)])
            with torch.inference_mode():
                return timed(lambda: hf_model.generate(prompt, max_new_tokens=1, do_sample=False))

        medians = interleaved_medians({"firsttoken": ours, "transformers": theirs}, args.repeats)
        ratio = medians["firsttoken"] / medians["transformers"]
        rows.append([length, medians["firsttoken"] * 1000, medians["transformers"] * 1000, ratio])
        results.append(
            {
                "prompt_tokens": length,
                "firsttoken_s": medians["firsttoken"],
                "transformers_s": medians["transformers"],
                "ratio": ratio,
            }
        )
    print(
        f"TTFT, {args.dtype}, median of {args.repeats} after a warm-up, measured in turns, "
        f"threads={torch.get_num_threads()}"
    )
    print_table(["prompt tokens", "firsttoken ms", "transformers ms", "ratio"], rows)
    print(
        "saved", save_result(f"ttft_vs_transformers_{args.dtype}", {"dtype": args.dtype, "results": results})
    )


if __name__ == "__main__":
    main()
