"""CPU prefill and decode speed: firsttoken against this machine's matmul rate and its peers.

    python bench/cpu_speed.py [--lengths 128 512 2048] [--repeats 5] [--skip-peers]

In one run and one process:
1. torch's bf16 and fp32 matmul rate on this machine (the roofline);
2. firsttoken's TTFT at each prompt length (bf16, prompt cache off), its achieved GFLOP/s
   (2 x non-embedding params x tokens + attention FLOPs, over TTFT) and that as a fraction
   of the bf16 matmul rate;
3. the same prompts through transformers (bf16 and fp32) and llama.cpp (llama-cpp-python on
   the same GGUF file, when installed), as TTFT ratios;
4. decode tokens/s at batch 1 after a 512-token prompt: firsttoken (bf16, and int8 weights)
   against llama.cpp.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import median_seconds, print_table, random_prompt, save_result, timed  # noqa: E402

from firsttoken import LLM, SamplingParams  # noqa: E402
from firsttoken.models.registry import default_model_path  # noqa: E402

GREEDY_ONE = SamplingParams(temperature=0, max_tokens=1)


def matmul_gflops(dtype: torch.dtype, size: int = 2048, repeats: int = 10) -> float:
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    for _ in range(3):
        a @ b
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * size**3 * repeats / (time.perf_counter() - start) / 1e9


def forward_flops(llm: LLM, num_tokens: int) -> float:
    """2 x non-embedding params per token, plus causal attention (QK^T and PV)."""
    arch = llm.engine.checkpoint.arch
    attention = 4 * arch.num_layers * arch.num_heads * arch.head_dim * num_tokens * (num_tokens + 1) / 2
    return 2 * arch.num_non_embedding_params * num_tokens + attention


def firsttoken_ttft(llm: LLM, length: int, repeats: int) -> float:
    def run(index: int) -> float:
        prompt = random_prompt(length, seed=7_000 + 100 * length + index)
        return timed(lambda: llm.generate(prompt_token_ids=[prompt], sampling_params=GREEDY_ONE))

    return median_seconds(run, repeats)[0]


def transformers_ttft(model, length: int, repeats: int) -> float:
    def run(index: int) -> float:
        prompt = torch.tensor([random_prompt(length, seed=7_000 + 100 * length + index)])
        with torch.inference_mode():
            return timed(lambda: model.generate(prompt, max_new_tokens=1, do_sample=False))

    return median_seconds(run, repeats)[0]


def llama_cpp_ttft(model, length: int, repeats: int) -> float:
    def run(index: int) -> float:
        prompt = random_prompt(length, seed=7_000 + 100 * length + index)
        model.reset()
        return timed(lambda: model.eval(prompt))

    return median_seconds(run, repeats)[0]


def firsttoken_decode_rate(llm: LLM, num_tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)
    rates = []
    for index in range(3):
        (output,) = llm.generate(prompt_token_ids=[random_prompt(512, seed=9_000 + index)], sampling_params=params)
        rates.append(output.metrics.decode_tokens_per_s)
    return statistics.median(rates)


def llama_cpp_decode_rate(model, num_tokens: int) -> float:
    rates = []
    for index in range(3):
        model.reset()
        model.eval(random_prompt(512, seed=9_000 + index))
        start = time.perf_counter()
        for _ in range(num_tokens):
            token = model.sample(temp=0.0)
            model.eval([token])
        rates.append(num_tokens / (time.perf_counter() - start))
    return statistics.median(rates)


def load_llama_cpp(path: str, max_len: int):
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    return Llama(path, n_ctx=max_len + 64, n_batch=max_len, n_ubatch=512, n_threads=torch.get_num_threads(), verbose=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--skip-peers", action="store_true", help="only firsttoken and the matmul rates")
    args = parser.parse_args()
    path = default_model_path()
    max_len = max(args.lengths)
    engine_options = dict(enable_prompt_cache=False, chunk_size=max_len, max_num_batched_tokens=max_len)
    llm = LLM(path, dtype="bfloat16", **engine_options)
    peak_bf16 = matmul_gflops(torch.bfloat16)
    peak_fp32 = matmul_gflops(torch.float32)
    print(f"torch matmul 2048^3: bf16 {peak_bf16:.0f} GFLOP/s, fp32 {peak_fp32:.0f} GFLOP/s, threads {torch.get_num_threads()}")

    ours = {length: firsttoken_ttft(llm, length, args.repeats) for length in args.lengths}
    results: dict = {"peak_bf16_gflops": peak_bf16, "peak_fp32_gflops": peak_fp32, "ttft_s": {"firsttoken_bf16": ours}}
    rows = []
    for length in args.lengths:
        achieved = forward_flops(llm, length) / ours[length] / 1e9
        rows.append([length, ours[length] * 1000, achieved, achieved / peak_bf16])
    print_table(["prompt tokens", "TTFT ms", "achieved GFLOP/s", "fraction of bf16 matmul"], rows)

    peers: dict[str, dict[int, float]] = {}
    if not args.skip_peers:
        from transformers import AutoModelForCausalLM

        folder, file_name = os.path.split(path)
        for dtype in (torch.bfloat16, torch.float32):
            model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file_name, dtype=dtype).eval()
            name = f"transformers_{str(dtype).removeprefix('torch.')}"
            peers[name] = {length: transformers_ttft(model, length, args.repeats) for length in args.lengths}
            del model
        llama = load_llama_cpp(path, max_len)
        if llama is not None:
            peers["llama.cpp"] = {length: llama_cpp_ttft(llama, length, args.repeats) for length in args.lengths}
        print_table(
            ["prompt tokens", "firsttoken ms"] + [f"{name} ms" for name in peers] + [f"ratio vs {name}" for name in peers],
            [
                [length, ours[length] * 1000]
                + [peers[name][length] * 1000 for name in peers]
                + [ours[length] / peers[name][length] for name in peers]
                for length in args.lengths
            ],
        )
        results["ttft_s"].update(peers)

    decode = {
        "firsttoken bf16": firsttoken_decode_rate(llm, args.decode_tokens),
        "firsttoken int8": firsttoken_decode_rate(LLM(path, dtype="bfloat16", quantization="int8", **engine_options), args.decode_tokens),
    }
    if not args.skip_peers and "llama.cpp" in peers:
        decode["llama.cpp"] = llama_cpp_decode_rate(llama, args.decode_tokens)
    baseline = decode.get("llama.cpp")
    print_table(
        ["decode at batch 1 after 512 tokens", "tokens/s", "ratio vs llama.cpp"],
        [[name, rate, rate / baseline if baseline else "-"] for name, rate in decode.items()],
    )
    results["decode_tokens_per_s"] = decode
    print("saved", save_result("cpu_speed", results))


if __name__ == "__main__":
    main()
