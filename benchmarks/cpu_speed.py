"""CPU prefill and decode speed: firsttoken against this machine's matmul rate and its peers.

    python benchmarks/cpu_speed.py [--lengths 128 512 2048] [--repeats 5] [--skip-peers]

In one run and one process, every system loaded side by side and timed in turns (so drift in
this machine's speed hits all of them alike):
1. torch's bf16 and fp32 matmul rate on this machine (the roofline), before and after;
2. firsttoken's TTFT at each prompt length (bf16, prompt cache off), its achieved GFLOP/s
   (2 x non-embedding params x tokens + attention FLOPs, over TTFT) and that as a fraction
   of the bf16 matmul rate;
3. the same prompts through transformers (bf16 and fp32) and llama.cpp (llama-cpp-python on
   the same GGUF file, when installed), as TTFT ratios;
4. decode tokens/s at batch 1 after a 512-token prompt: firsttoken (bf16, int8 and int4
   weights for decode; int4 also stepping op by op instead of its whole-step native decode)
   against llama.cpp.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import interleaved_medians, print_table, random_prompt, save_result, timed  # noqa: E402

from firsttoken import LLM, SamplingParams  # noqa: E402
from firsttoken.models.registry import default_model_path  # noqa: E402

GREEDY_ONE = SamplingParams(temperature=0, max_tokens=1)
DECODE_PROMPT_LEN = 512


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
    arch = llm.core.worker.checkpoint.arch
    attention = 4 * arch.num_layers * arch.num_heads * arch.head_dim * num_tokens * (num_tokens + 1) / 2
    return 2 * arch.num_non_embedding_params * num_tokens + attention


def prompt_for(length: int, index: int) -> list[int]:
    return random_prompt(length, seed=7_000 + 100 * length + index)


def firsttoken_ttft_run(llm: LLM, length: int):
    return lambda index: timed(
        lambda: llm.generate(prompt_token_ids=[prompt_for(length, index)], sampling_params=GREEDY_ONE)
    )


def transformers_ttft_run(model, length: int):
    def run(index: int) -> float:
        prompt = torch.tensor([prompt_for(length, index)])
        with torch.inference_mode():
            return timed(lambda: model.generate(prompt, max_new_tokens=1, do_sample=False))

    return run


def llama_cpp_ttft_run(model, length: int):
    def run(index: int) -> float:
        prompt = prompt_for(length, index)
        model.reset()
        return timed(lambda: model.eval(prompt))

    return run


def firsttoken_decode_run(llm: LLM, num_tokens: int, native_step: bool = True):
    """Seconds per decoded token at batch 1 after a 512-token prompt; `native_step=False`
    sets the runner's whole-step native decode aside for the run (the per-op path)."""
    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)
    runner = llm.core.worker.runner
    whole_step = runner.whole_step_decode

    def run(index: int) -> float:
        runner.whole_step_decode = whole_step if native_step else None
        prompt = random_prompt(DECODE_PROMPT_LEN, seed=9_000 + index)
        (output,) = llm.generate(prompt_token_ids=[prompt], sampling_params=params)
        return 1.0 / output.metrics.decode_tokens_per_s

    return run


def llama_cpp_decode_run(model, num_tokens: int):
    def run(index: int) -> float:
        model.reset()
        model.eval(random_prompt(DECODE_PROMPT_LEN, seed=9_000 + index))
        start = time.perf_counter()
        for _ in range(num_tokens):
            token = model.sample(temp=0.0)
            model.eval([token])
        return (time.perf_counter() - start) / num_tokens

    return run


def load_llama_cpp(path: str, max_len: int):
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    return Llama(
        path,
        n_ctx=max_len + 64,
        n_batch=max_len,
        n_ubatch=512,
        n_threads=torch.get_num_threads(),
        verbose=False,
    )


def load_transformers(path: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    folder, file_name = os.path.split(path)
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=file_name, dtype=dtype).eval()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--skip-peers", action="store_true", help="only firsttoken and the matmul rates")
    args = parser.parse_args()
    path = default_model_path()
    max_len = max(max(args.lengths), DECODE_PROMPT_LEN + args.decode_tokens)
    engine_options = dict(enable_prompt_cache=False, chunk_size=max_len, max_num_batched_tokens=max_len)
    llm = LLM(path, dtype="bfloat16", **engine_options)
    quantized = {
        quantization: LLM(path, dtype="bfloat16", quantization=quantization, **engine_options)
        for quantization in ("int8", "int4")
    }
    peers: dict[str, object] = {}
    if not args.skip_peers:
        peers["transformers bf16"] = load_transformers(path, torch.bfloat16)
        peers["transformers fp32"] = load_transformers(path, torch.float32)
        llama = load_llama_cpp(path, max_len)
        if llama is not None:
            peers["llama.cpp"] = llama

    peaks_bf16, peaks_fp32 = [matmul_gflops(torch.bfloat16)], [matmul_gflops(torch.float32)]
    ttft: dict[str, dict[int, float]] = {"firsttoken bf16": {}, **{name: {} for name in peers}}
    for length in args.lengths:
        runs = {"firsttoken bf16": firsttoken_ttft_run(llm, length)}
        for name, model in peers.items():
            runs[name] = (
                llama_cpp_ttft_run(model, length)
                if name == "llama.cpp"
                else transformers_ttft_run(model, length)
            )
        for name, seconds in interleaved_medians(runs, args.repeats).items():
            ttft[name][length] = seconds
    peaks_bf16.append(matmul_gflops(torch.bfloat16))
    peaks_fp32.append(matmul_gflops(torch.float32))
    peak_bf16, peak_fp32 = max(peaks_bf16), max(peaks_fp32)
    print(
        f"torch matmul 2048^3 (best of before/after): bf16 {peak_bf16:.0f} GFLOP/s "
        f"({peaks_bf16[0]:.0f}/{peaks_bf16[1]:.0f}), fp32 {peak_fp32:.0f} GFLOP/s, threads "
        f"{torch.get_num_threads()}"
    )

    ours = ttft["firsttoken bf16"]
    rows = []
    for length in args.lengths:
        achieved = forward_flops(llm, length) / ours[length] / 1e9
        rows.append([length, ours[length] * 1000, achieved, achieved / peak_bf16])
    print_table(["prompt tokens", "TTFT ms", "achieved GFLOP/s", "fraction of bf16 matmul"], rows)
    if peers:
        print_table(
            ["prompt tokens", "firsttoken ms"]
            + [f"{name} ms" for name in peers]
            + [f"ratio vs {name}" for name in peers],
            [
                [length, ours[length] * 1000]
                + [ttft[name][length] * 1000 for name in peers]
                + [ours[length] / ttft[name][length] for name in peers]
                for length in args.lengths
            ],
        )

    decode_runs = {
        "firsttoken bf16": firsttoken_decode_run(llm, args.decode_tokens),
        **{
            f"firsttoken {quantization}": firsttoken_decode_run(engine, args.decode_tokens)
            for quantization, engine in quantized.items()
        },
    }
    if quantized["int4"].core.worker.runner.whole_step_decode is not None:
        decode_runs["firsttoken int4, per-op decode"] = firsttoken_decode_run(
            quantized["int4"], args.decode_tokens, native_step=False
        )
    if "llama.cpp" in peers:
        decode_runs["llama.cpp"] = llama_cpp_decode_run(peers["llama.cpp"], args.decode_tokens)
    decode = {name: 1.0 / seconds for name, seconds in interleaved_medians(decode_runs, args.repeats).items()}
    baseline = decode.get("llama.cpp")
    print_table(
        [f"decode at batch 1 after {DECODE_PROMPT_LEN} tokens", "tokens/s", "ratio vs llama.cpp"],
        [[name, rate, rate / baseline if baseline else "-"] for name, rate in decode.items()],
    )
    results = {
        "peak_bf16_gflops": peak_bf16,
        "peak_fp32_gflops": peak_fp32,
        "ttft_s": ttft,
        "decode_tokens_per_s": decode,
    }
    print("saved", save_result("cpu_speed", results))


if __name__ == "__main__":
    main()
