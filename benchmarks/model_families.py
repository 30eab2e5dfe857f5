"""TTFT and decode of each model family firsttoken loads, on random 2-layer models of the same
shapes (SmolLM2-135M's layers: hidden 576, 9 query and 3 KV heads of 64, MLP 1536), so what a
family's differences cost (biases, query/key norms, Gemma's sandwich norms and GeGLU, windows)
shows against Llama in one run.

Each family is written as a Hugging Face folder by transformers (a dev dependency) into a
temporary folder. TTFT of fresh random prompts, medians of `--repeats` taken in turns; decode
is the mean time per token after the first of `--decode-tokens` + 1, after a 512-token prompt
(medians, in turns, too).

    python benchmarks/model_families.py --lengths 512 4096
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import first_token_run, interleaved_medians, print_table, random_prompt, save_result  # noqa: E402

from firsttoken import LLM, SamplingParams  # noqa: E402
from firsttoken.models.registry import default_model_path, open_checkpoint  # noqa: E402

# Decode is timed after a prompt of this many tokens, whatever --lengths are.
DECODE_PROMPT_TOKENS = 512
SHAPES = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=2,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    max_position_embeddings=8192,
)
# Each family's config beyond the shared shapes: its defaults, windows where it has them.
FAMILIES = {
    "llama": ("llama", {}),
    "qwen2 (QKV bias)": ("qwen2", {}),
    "qwen3 (QK norm)": ("qwen3", {}),
    "mistral (window 1024)": ("mistral", {"sliding_window": 1024}),
    "phi3": ("phi3", {"sliding_window": None}),
    "gemma2 (local 1024 + global, soft-cap)": (
        "gemma2",
        {"sliding_window": 1024, "layer_types": ["sliding_attention", "full_attention"]},
    ),
    "gemma3 (local 1024 + global)": (
        "gemma3_text",
        {"sliding_window": 1024, "layer_types": ["sliding_attention", "full_attention"]},
    ),
}


def write_family(folder: str, model_type: str, overrides: dict) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = open_checkpoint(default_model_path()).tokenizer.backend
    config = AutoConfig.for_model(
        model_type, vocab_size=tokenizer.get_vocab_size(), tie_word_embeddings=True, **{**SHAPES, **overrides}
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save(f"{folder}/tokenizer.json")
    return folder


def decode_run(llm: LLM, decode_tokens: int) -> Callable[[int], float]:
    """run(i) for `interleaved_medians`: mean seconds per token after the first, after a fresh
    DECODE_PROMPT_TOKENS-token prompt (seed i)."""
    params = SamplingParams(temperature=0, max_tokens=decode_tokens + 1, ignore_eos=True)

    def run(index: int) -> float:
        prompt = random_prompt(DECODE_PROMPT_TOKENS, seed=index)
        token_times = [time.perf_counter() for _ in llm.stream(prompt, params)]
        return statistics.mean(later - earlier for earlier, later in zip(token_times, token_times[1:]))

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 4096])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    greedy_one = SamplingParams(temperature=0, max_tokens=1)
    with tempfile.TemporaryDirectory() as folder:
        engines = {
            name: LLM(
                write_family(f"{folder}/{index}", model_type, overrides),
                dtype=args.dtype,
                enable_prompt_cache=False,
                max_model_len=max(*args.lengths, DECODE_PROMPT_TOKENS + args.decode_tokens) + 64,
            )
            for index, (name, (model_type, overrides)) in enumerate(FAMILIES.items())
        }
        ttft = {
            length: interleaved_medians(
                {
                    name: first_token_run(llm, length, greedy_one, first_seed=length)
                    for name, llm in engines.items()
                },
                repeats=args.repeats,
            )
            for length in args.lengths
        }
        decode = interleaved_medians(
            {name: decode_run(llm, args.decode_tokens) for name, llm in engines.items()}, repeats=args.repeats
        )
    baseline = next(iter(FAMILIES))
    rows = []
    for name in FAMILIES:
        row = [name]
        for length in args.lengths:
            row += [ttft[length][name] * 1e3, ttft[length][name] / ttft[length][baseline]]
        row += [decode[name] * 1e3, decode[name] / decode[baseline]]
        rows.append(row)
    headers = ["family"]
    for length in args.lengths:
        headers += [f"TTFT {length} ms", "vs llama"]
    headers += ["decode ms/token", "vs llama"]
    print(f"2 layers of SmolLM2-135M's shapes, {args.dtype}, {torch.get_num_threads()} threads")
    print_table(headers, rows)
    print("saved", save_result("model_families", {"args": vars(args), "ttft_s": ttft, "decode_s": decode}))


if __name__ == "__main__":
    main()
