"""CPU prefill and decode speed: firsttoken against this machine's matmul rate and its peers.

    python benchmarks/cpu_speed.py [--lengths 128 512 2048] [--repeats 5] [--dtype auto] [--skip-peers]

In one run and one process, every system loaded side by side and timed in turns (so drift in
this machine's speed hits all of them alike):
1. torch's matmul rate in `--dtype` (and fp32 beside bf16) on this machine (the roofline),
   before and after;
2. firsttoken's TTFT at each prompt length (in `--dtype`, prompt cache off), its achieved
   GFLOP/s (2 x non-embedding params x tokens + attention FLOPs, over TTFT) and that as a
   fraction of torch's matmul rate in the same dtype;
3. the same prompts through transformers (in `--dtype`, and fp32 beside bf16) and llama.cpp
   (llama-cpp-python on the same GGUF file, when installed), as TTFT ratios;
4. decode tokens/s at batch 1 after a 512-token prompt: firsttoken (`--dtype`, int8 and int4
   weights for decode; int4 also stepping op by op instead of its whole-step native decode)
   against llama.cpp.

`--dtype auto` (the default) is what an engine picks here: bf16 where the CPU multiplies bf16
natively (AVX512-BF16 or AMX), float32 elsewhere, where bf16 arithmetic is emulated and a bf16
run measures the emulation.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import interleaved_medians, print_table, random_prompt, save_result, timed  # noqa: E402

from firsttoken import LLM, SamplingParams  # noqa: E402
from firsttoken.models.registry import default_model_path  # noqa: E402
from firsttoken.outputs import WHOLE_STEP_INT4_DECODE  # noqa: E402

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
    arch = llm.core.single_rank_model().arch
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

    def run(index: int) -> float:
        prompt = random_prompt(DECODE_PROMPT_LEN, seed=9_000 + index)
        with llm.core.forward_op_by_op() if not native_step else contextlib.nullcontext():
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


DTYPE_LABELS = {torch.bfloat16: "bf16", torch.float32: "fp32"}


def matmul_rates(dtypes: list[torch.dtype]) -> dict[torch.dtype, float]:
    return {dtype: matmul_gflops(dtype) for dtype in dtypes}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    parser.add_argument("--skip-peers", action="store_true", help="only firsttoken and the matmul rates")
    args = parser.parse_args()
    path = default_model_path()
    max_len = max(max(args.lengths), DECODE_PROMPT_LEN + args.decode_tokens)
    engine_options = dict(
        dtype=args.dtype, enable_prompt_cache=False, chunk_size=max_len, max_num_batched_tokens=max_len
    )
    llm = LLM(path, **engine_options)
    quantized = {
        quantization: LLM(path, quantization=quantization, **engine_options)
        for quantization in ("int8", "int4")
    }
    dtype = getattr(torch, llm.inspect().dtype)
    label = DTYPE_LABELS[dtype]
    # float32 is the reference rate beside bf16; bf16's rate is measured only when bf16 runs.
    matmul_dtypes = [dtype] if dtype == torch.float32 else [dtype, torch.float32]
    peers: dict[str, object] = {}
    if not args.skip_peers:
        for peer_dtype in matmul_dtypes:
            peers[f"transformers {DTYPE_LABELS[peer_dtype]}"] = load_transformers(path, peer_dtype)
        llama = load_llama_cpp(path, max_len)
        if llama is not None:
            peers["llama.cpp"] = llama

    ours_name = f"firsttoken {label}"
    rates_before = matmul_rates(matmul_dtypes)
    ttft: dict[str, dict[int, float]] = {ours_name: {}, **{name: {} for name in peers}}
    for length in args.lengths:
        runs = {ours_name: firsttoken_ttft_run(llm, length)}
        for name, model in peers.items():
            runs[name] = (
                llama_cpp_ttft_run(model, length)
                if name == "llama.cpp"
                else transformers_ttft_run(model, length)
            )
        for name, seconds in interleaved_medians(runs, args.repeats).items():
            ttft[name][length] = seconds
    rates_after = matmul_rates(matmul_dtypes)
    peaks = {each: max(rates_before[each], rates_after[each]) for each in matmul_dtypes}
    print(
        "torch matmul 2048^3 (best of before/after): "
        + ", ".join(
            f"{DTYPE_LABELS[each]} {peaks[each]:.0f} GFLOP/s "
            f"({rates_before[each]:.0f}/{rates_after[each]:.0f})"
            for each in matmul_dtypes
        )
        + f", threads {torch.get_num_threads()}"
    )

    ours = ttft[ours_name]
    rows = []
    for length in args.lengths:
        achieved = forward_flops(llm, length) / ours[length] / 1e9
        rows.append([length, ours[length] * 1000, achieved, achieved / peaks[dtype]])
    print_table(
        [f"prompt tokens ({label})", "TTFT ms", "achieved GFLOP/s", f"fraction of {label} matmul"], rows
    )
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
        ours_name: firsttoken_decode_run(llm, args.decode_tokens),
        **{
            f"firsttoken {quantization}": firsttoken_decode_run(engine, args.decode_tokens)
            for quantization, engine in quantized.items()
        },
    }
    if WHOLE_STEP_INT4_DECODE in quantized["int4"].inspect().whole_step_forwards:
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
        "dtype": label,
        "matmul_gflops": {DTYPE_LABELS[each]: rate for each, rate in peaks.items()},
        "ttft_s": ttft,
        "decode_tokens_per_s": decode,
    }
    print("saved", save_result("cpu_speed", results))


if __name__ == "__main__":
    main()
