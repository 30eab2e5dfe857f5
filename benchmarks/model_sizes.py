"""firsttoken at the model sizes people run, against vLLM-CPU and llama.cpp on the same files.

The checkpoints are `make_checkpoint.py`'s (random weights at real shapes: speed does not depend
on the values), made first where missing. Each engine runs in its own fresh process, one after
the other, on the same random token ids:

- firsttoken on the transformers folder (bf16 safetensors) and on each GGUF file, with its
  defaults (dtype, kernels and chunking chosen at start);
- vLLM-CPU on the transformers folder, in each dtype asked for (its faster one depends on the CPU);
- llama.cpp (llama-cpp-python) on each GGUF file, with as many threads as cores.

Per run: start to first token (the process's launch to the first token of a 16-token prompt,
page cache warm, or cold with `--cold`: the files' pages are dropped first), TTFT at each length
(median of 3), batch-1 decode after 128 tokens (ms/token, median of 3), and peak RSS. Decode rows
also state the fraction of this machine's read bandwidth they reach (the file's bytes of weights
read per token over the step time, against torch's sum over 1 GiB: an engine's streaming kernels
can beat that, so a fraction over 1 is possible), prefill rows their rate in GFLOP/s (to compare
with torch's GEMM rates printed first).

    python benchmarks/make_checkpoint.py llama-3.2-1b --formats hf gguf-bf16 Q8_0 Q4_K_M \
        --llama-cpp-python ~/.cache/firsttoken-peers/llamacpp/bin/python
    python benchmarks/model_sizes.py llama-3.2-1b --formats hf Q8_0 Q4_K_M \
        --vllm-python ~/.cache/firsttoken-peers/vllm/bin/python \
        --llama-cpp-python ~/.cache/firsttoken-peers/llamacpp/bin/python
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import print_table, save_result  # noqa: E402

# Its token ids are of the embedded tokenizer's range, which every checkpoint's vocabulary covers.
from vs_vllm_cpu import decode_ms_per_token, token_ids, vllm_environment  # noqa: E402

if TYPE_CHECKING:
    from make_checkpoint import Shape

RESULT_PREFIX = "RESULT "
START_PROMPT_TOKENS = 16
DECODE_AFTER = 128
DECODE_TOKENS = 32
REPEATS = 3
MAX_MODEL_LEN = 4096
# generate(ids, max_tokens) runs one request to completion.
Generate = Callable[[list[int], int], None]


def measure(generate: Generate, launched_at: float, lengths: list[int]) -> dict[str, float]:
    """The figures of one engine's process, `generate` loaded and not yet called."""
    generate(token_ids(START_PROMPT_TOKENS, 1), 1)
    figures = {"start to first token (s)": time.time() - launched_at}
    for length in lengths:
        generate(token_ids(length, 2), 1)
        times = []
        for index in range(REPEATS):
            start = time.perf_counter()
            generate(token_ids(length, 100 + length + index), 1)
            times.append(time.perf_counter() - start)
        figures[f"TTFT {length} (ms)"] = statistics.median(times) * 1e3
    figures["decode (ms/token)"] = decode_ms_per_token(generate, DECODE_AFTER, DECODE_TOKENS)
    figures["peak RSS (GiB)"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return figures


def firsttoken_generate(path: str) -> Generate:
    from firsttoken import LLM, SamplingParams

    llm = LLM(model=path, max_model_len=MAX_MODEL_LEN)

    def generate(ids: list[int], max_tokens: int) -> None:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        llm.generate(prompt_token_ids=[ids], sampling_params=params)

    return generate


def vllm_generate(path: str, dtype: str) -> Generate:
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=path,
        dtype=dtype,
        max_model_len=MAX_MODEL_LEN,
        enable_prefix_caching=True,
        max_num_batched_tokens=MAX_MODEL_LEN,
    )

    def generate(ids: list[int], max_tokens: int) -> None:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)

    return generate


def llama_cpp_generate(path: str) -> Generate:
    from llama_cpp import Llama

    threads = os.cpu_count()
    llm = Llama(
        model_path=path,
        n_ctx=MAX_MODEL_LEN,
        n_batch=MAX_MODEL_LEN,
        n_ubatch=512,
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
    )

    def generate(ids: list[int], max_tokens: int) -> None:
        # A fresh context each request: no prefix reuse, as the distinct prompts of the others.
        llm.reset()
        llm.create_completion(ids, max_tokens=max_tokens, temperature=0.0, top_k=1)

    return generate


def engine_process(engine: str, path: str, dtype: str, lengths: list[int], launched_at: float) -> None:
    if engine == "firsttoken":
        generate = firsttoken_generate(path)
    elif engine == "vllm":
        generate = vllm_generate(path, dtype)
    else:
        generate = llama_cpp_generate(path)
    print(RESULT_PREFIX + json.dumps(measure(generate, launched_at, lengths)), flush=True)


def run_engine(python: str, engine: str, path: str, dtype: str, lengths: list[int], cold: bool) -> dict:
    if cold:
        drop_page_cache(path)
    environment = dict(os.environ)
    if engine == "vllm":
        # In-process, so that its engine's memory is this process's peak RSS.
        environment = {**vllm_environment(python), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    command = [
        python,
        os.path.abspath(__file__),
        "--as-engine",
        engine,
        path,
        "--dtype",
        dtype,
        "--lengths",
        *map(str, lengths),
        "--launched-at",
        repr(time.time()),
    ]
    finished = subprocess.run(command, capture_output=True, text=True, env=environment, check=False)
    for line in finished.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX) :])
    raise SystemExit(f"{engine} on {path} failed (exit {finished.returncode}):\n{finished.stderr[-3000:]}")


def drop_page_cache(path: str) -> None:
    """Drops the file's (or folder's files') clean pages from the page cache."""
    files = [os.path.join(path, name) for name in os.listdir(path)] if os.path.isdir(path) else [path]
    for file_path in files:
        descriptor = os.open(file_path, os.O_RDONLY)
        try:
            os.fsync(descriptor)
            os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(descriptor)


def read_bandwidth() -> float:
    """Bytes per second this machine's cores read: the median of 5 sums of a 1 GiB array."""
    import torch

    values = torch.ones(2**28)
    times = []
    for _ in range(6):
        start = time.perf_counter()
        values.sum()
        times.append(time.perf_counter() - start)
    return values.nbytes / statistics.median(times[1:])


def gemm_rate(shape: Shape, dtype_name: str) -> float:
    """FLOP/s of torch's matmul at a 512-token prefill's gate/up projection, in this dtype."""
    import torch

    dtype = getattr(torch, dtype_name)
    activations = torch.randn(512, shape.hidden_size).to(dtype)
    weight = torch.randn(2 * shape.intermediate_size, shape.hidden_size).to(dtype)
    times = []
    for _ in range(6):
        start = time.perf_counter()
        torch.nn.functional.linear(activations, weight)
        times.append(time.perf_counter() - start)
    return 2 * activations.shape[0] * weight.numel() / statistics.median(times[1:])


def weight_bytes_read_per_token(path: str, shape: Shape) -> int:
    """Bytes of the weights a decode step reads: every tensor but the embedding rows it gathers
    (the whole table when it is also the LM head)."""
    if os.path.isdir(path):
        from safetensors import safe_open

        total = 0
        for name in os.listdir(path):
            if name.endswith(".safetensors"):
                with safe_open(os.path.join(path, name), framework="pt") as handle:
                    total += sum(
                        math.prod(handle.get_slice(key).get_shape()) * 2  # bf16
                        for key in handle.keys()
                        if key != "model.embed_tokens.weight" or shape.tie_word_embeddings
                    )
        return total
    from gguf import GGUFReader

    reader = GGUFReader(path)
    return sum(
        int(tensor.n_bytes)
        for tensor in reader.tensors
        if tensor.name != "token_embd.weight" or shape.tie_word_embeddings
    )


def prefill_flops(shape: Shape, num_tokens: int) -> float:
    """Multiply-adds x 2 of a prefill: its projections, causal attention and one LM-head row."""
    kv_size = shape.num_kv_heads * shape.head_dim
    per_token = shape.num_layers * (
        shape.hidden_size * (2 * shape.hidden_size + 2 * kv_size)
        + 3 * shape.hidden_size * shape.intermediate_size
    )
    attention = shape.num_layers * 2 * shape.hidden_size * num_tokens * (num_tokens + 1) / 2
    return 2 * (per_token * num_tokens + attention + shape.vocab_size * shape.hidden_size)


def main() -> None:
    # The checkpoints' module needs torch, which the engines' processes of other environments lack.
    from make_checkpoint import DEFAULT_CACHE, SHAPES, make

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("model", nargs="?", choices=sorted(SHAPES))
    parser.add_argument("--formats", nargs="+", default=["hf", "Q4_K_M"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache-dir", default=DEFAULT_CACHE)
    parser.add_argument("--lengths", nargs="+", type=int, default=[128, 512])
    parser.add_argument("--vllm-python", help="the Python of an environment with vllm-cpu installed")
    parser.add_argument("--vllm-dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--llama-cpp-python", help="the Python of an environment with llama-cpp-python")
    parser.add_argument("--cold", action="store_true", help="drop the files' pages before each start")
    args = parser.parse_args()
    if args.model is None:
        parser.error("the model is required")
    shape = SHAPES[args.model]
    runs = []
    paths = make(args.model, args.formats, args.seed, args.cache_dir, args.llama_cpp_python)
    # Files just written are still being written back: that would slow the first engine's run.
    os.sync()
    for file_format, path in paths.items():
        runs.append(("firsttoken", file_format, "auto", sys.executable, path))
        if file_format == "hf" and args.vllm_python:
            runs += [("vLLM-CPU", file_format, dtype, args.vllm_python, path) for dtype in args.vllm_dtypes]
        if file_format != "hf" and args.llama_cpp_python:
            runs.append(("llama.cpp", file_format, "", args.llama_cpp_python, path))
    bandwidth = read_bandwidth()
    rates = {dtype: gemm_rate(shape, dtype) for dtype in ("float32", "bfloat16")}
    print(
        f"read bandwidth {bandwidth / 1e9:.1f} GB/s; torch GEMM float32 {rates['float32'] / 1e9:.0f}, "
        f"bf16 {rates['bfloat16'] / 1e9:.0f} GFLOP/s"
    )
    results = []
    for name, file_format, dtype, python, path in runs:
        engine = {"firsttoken": "firsttoken", "vLLM-CPU": "vllm", "llama.cpp": "llama_cpp"}[name]
        print(f"running {name} on {file_format} {dtype}".rstrip(), file=sys.stderr, flush=True)
        figures = run_engine(python, engine, path, dtype or "auto", args.lengths, args.cold)
        step_bytes = weight_bytes_read_per_token(path, shape)
        figures["decode, fraction of read bandwidth"] = (
            step_bytes / (figures["decode (ms/token)"] / 1e3) / bandwidth
        )
        results.append({"engine": name, "format": file_format, "dtype": dtype, "figures": figures})
        print(f"  {json.dumps(figures)}", file=sys.stderr, flush=True)
    names = list(results[0]["figures"])
    headers = ["", *(f"{r['engine']} {r['format']} {r['dtype']}".strip() for r in results)]
    rows = [[name, *(r["figures"].get(name, "") for r in results)] for name in names]
    for length in args.lengths:
        flops = prefill_flops(shape, length)
        rows.append(
            [f"TTFT {length}, GFLOP/s", *(flops / r["figures"][f"TTFT {length} (ms)"] / 1e6 for r in results)]
        )
    print(f"\n{args.model} ({'cold' if args.cold else 'warm'} page cache), one process per column")
    print_table(headers, rows)
    payload = {"model": args.model, "bandwidth": bandwidth, "gemm_rates": rates, "results": results}
    path = save_result(f"model_sizes_{args.model}", payload)
    print(f"\nwritten to {path}")


def engine_main() -> None:
    """An engine's own process (`run_engine`), in that engine's environment."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--as-engine", nargs=2, metavar=("ENGINE", "PATH"), required=True)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--lengths", nargs="+", type=int, required=True)
    parser.add_argument("--launched-at", type=float, required=True)
    args = parser.parse_args()
    engine_process(*args.as_engine, args.dtype, args.lengths, args.launched_at)


if __name__ == "__main__":
    if "--as-engine" in sys.argv:
        engine_main()
    else:
        main()
