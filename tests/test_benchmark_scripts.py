"""Every script under benchmarks/ runs to its end on tiny arguments, so a script whose private
hooks into the engine drifted from the code fails here instead of when someone measures with it.

The scripts run from a copy of the folder, so their JSON goes to the copy's bench_results/, not
the checkout's. What they print is measured elsewhere; here only that they finish.
"""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

import pytest

from tests.conftest import cpu_has_bf16_instructions

ROOT = pathlib.Path(__file__).parents[1]
BENCHMARKS = ROOT / "benchmarks"
# The text w8a8.py and w8a8_methods.py measure quality on and calibrate with: the docs, for a
# machine without Debian's GPL-3 text (their default).
W8A8_TEXT_NAME = "docs.txt"
# Scripts that need what the tests cannot have: a peer installed beside firsttoken.
NEEDS_A_PEER = {
    "grammar_engines.py": "xgrammar, which is not a dependency",
    "vs_vllm_cpu.py": "vLLM in a Python of its own",
    "vs_vllm_cpu_serve.py": "vLLM in a Python of its own",
}
# Scripts that need the native prefill attention (AVX512-BF16 or AMX).
NEEDS_BF16_INSTRUCTIONS = {"chunk_attention.py"}
TINY_ARGUMENTS = {
    "batch_invariance.py": "--input-lens 16 --decode-batches 1 --repeats 1",
    "busy_machine.py": "--busy 1 --rounds 1 --runs 1 --input-len 16 --output-len 2 --skip-quiet",
    "chunk_attention.py": "--repeats 1 --shapes 128:32",
    "chunk_policy.py": "--loads 64/4 --fractions 1 --chunks 2048 --num-prompts 3",
    "compare_peers.py": "--input-lens 32 --output-len 4 --runs 1 --warmup-runs 0 --no-llama-cpp",
    "compute_forms.py": "--input-len 16 --decode-tokens 2 --repeats 1",
    "cpu_attention.py": "--lengths 128 --contexts 128",
    "cpu_classes.py": "--isa avx2 --lengths 64 --repeats 1 --decode-tokens 4",
    "cpu_speed.py": "--lengths 64 --repeats 1 --decode-tokens 4 --skip-peers",
    "engine_start.py": "--repeats 1 --warm-up-tokens 16 --prompt-len 16",
    "gpu_check.py": "--device cpu --tiny",
    "head_of_line.py": "--duration 5 --configs auto --long-len 256 --short-len 16 --streams 1",
    "make_checkpoint.py": "tiny-llama3 --cache-dir checkpoints",
    "model_families.py": "--lengths 64 --repeats 1 --decode-tokens 4",
    "model_sizes.py": "tiny-llama3 --formats hf gguf-bf16 --cache-dir checkpoints --lengths 32",
    "native_kernels.py": "--lengths 64 --repeats 1 --decode-tokens 4",
    "prompt_cache.py": "--prefix-len 64 --suffix-len 8 --repeats 1",
    "quantized_decode.py": "--repeats 1",
    "quantized_prefill.py": "--length 64 --repeats 1",
    "replicas.py": "--replicas 2 --threads-per-replica 1 --prefix-len 64 --prompts-per-group 2 "
    "--output-len 4 --rounds 1",
    "row_invariant_matmul.py": "--rows 16 --repeats 1 --lengths 64 --engine-repeats 1 --decode-tokens 4",
    "sampler.py": "--rows 4 --repeats 1",
    "sliding_window.py": "--contexts 256 --decode-tokens 4",
    "speculative.py": "--max-tokens 8 --batches 1 --repeats 1",
    "structured_output.py": "--repeats 1 --rows 2",
    "tensor_parallel.py": "--input-lens 32 --decode-batches 1 --repeats 1",
    "ttft_objective.py": "--rate 2 --ttft-slo-ms 1000 --num-prompts 4 --input-len 64 --output-len 4",
    "ttft_vs_transformers.py": "--lengths 64 --repeats 1",
    "w8a8.py": (
        f"--windows 1 --lengths 64 --rounds 1 --repeats 1 --dtypes float32 --calibration-tokens 256 "
        f"--text {W8A8_TEXT_NAME}"
    ),
    "w8a8_matmul.py": "--rows 16 --repeats 1",
    "w8a8_methods.py": (
        f"--windows 1 --methods rtn-smoothed rotated-gptq rotated-gptq-float-down_proj-inputs "
        f"--text {W8A8_TEXT_NAME}"
    ),
}
# Modules the scripts import, not scripts themselves: common.py, shared by all, and the steps of
# gpu_check.py, split by what each measures.
HELPER_MODULES = {
    "common.py",
    "gpu_check_invariance.py",
    "gpu_check_models.py",
    "gpu_check_parity.py",
    "gpu_check_plan.py",
    "gpu_check_speed.py",
}


def test_every_script_has_tiny_arguments_or_a_reason_it_cannot_run_here():
    scripts = {path.name for path in BENCHMARKS.glob("*.py")} - HELPER_MODULES
    assert scripts == set(TINY_ARGUMENTS) | set(NEEDS_A_PEER)


@pytest.fixture(scope="module")
def benchmarks_copy(tmp_path_factory) -> pathlib.Path:
    """A copy of benchmarks/ (its results go beside it) and the text w8a8.py reads."""
    root = tmp_path_factory.mktemp("benchmarks-copy")
    shutil.copytree(BENCHMARKS, root / "benchmarks", ignore=shutil.ignore_patterns("__pycache__"))
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    (root / W8A8_TEXT_NAME).write_text("\n\n".join(page.read_text() for page in pages))
    return root


@pytest.mark.slow  # ~7 minutes in all, each script starting engines of its own
# w8a8.py starts five engines (and each again in a process of its own for TTFT) and rounds the
# model by GPTQ: 3.5 minutes alone on 2 first-generation Zen cores (before the processes), over 8
# beside another slow test's GPTQ.
@pytest.mark.timeout(960)
@pytest.mark.parametrize("script", sorted(TINY_ARGUMENTS))
def test_the_script_runs_to_its_end(benchmarks_copy, script):
    if script in NEEDS_BF16_INSTRUCTIONS and not cpu_has_bf16_instructions():
        pytest.skip(f"{script} needs the native prefill attention (AVX512-BF16 or AMX)")
    command = [sys.executable, f"benchmarks/{script}", *TINY_ARGUMENTS[script].split()]
    finished = subprocess.run(command, cwd=benchmarks_copy, capture_output=True, text=True, timeout=900)
    assert finished.returncode == 0, finished.stdout[-2000:] + finished.stderr[-4000:]
