"""benchmarks/gpu_check.py and its steps (gpu_check_*.py beside it): the parity rule and FLOP count,
and the CPU smoke run end to end as the GPU image would run it (no gguf package, the repository on
sys.path)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

from gpu_check import exit_status  # noqa: E402
from gpu_check_parity import ParityResult, count_misses, leading_matches  # noqa: E402
from gpu_check_plan import FULL_PLAN, LLAMA2_7B, SMOLLM2_135M, TINY_MHA, TINY_PLAN  # noqa: E402
from gpu_check_speed import ttft_lengths, ttft_target  # noqa: E402

# Runs the script with the packages the GPU image lacks made unimportable.
_RUN_WITHOUT = """
import importlib.abc, runpy, sys
class Missing(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in {"gguf", "fastapi", "uvicorn", "orjson", "prometheus_client", "matplotlib"}:
            raise ModuleNotFoundError(name)
sys.meta_path.insert(0, Missing())
script = %r
sys.argv = [script] + sys.argv[1:]
runpy.run_path(script, run_name="__main__")
"""


def test_count_misses_tolerates_near_ties_only():
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 2.9, 0.0], [4.0, 0.0, 1.0]])
    # Step 0 agrees, step 1 differs at a gap of 0.1, step 2 differs at a gap of 3.
    assert count_misses([1, 1, 2], logits, near_tie=0.25) == (1, 1)
    assert count_misses([1, 0, 0], logits, near_tie=0.25) == (0, 0)


def _result(clear_misses: int, logprob_error: float) -> ParityResult:
    return ParityResult("s", 10, 0, 4, 4, 0, clear_misses, logprob_error, 0.25)


def test_exit_status_fails_on_a_clear_miss_a_logprob_gap_or_no_checks():
    assert exit_status([_result(0, 0.1), _result(0, 0.2)], []) == 0
    assert exit_status([_result(0, 0.1), _result(1, 0.2)], []) == 1
    assert exit_status([_result(0, 0.3)], []) == 1
    assert exit_status([], []) == 1


def test_exit_status_fails_where_claimed_batch_invariance_moved_a_bit():
    held = {"engine": "invariant", "claimed": True, "must_claim": True, "same_bits_beside_others": True}
    moved = held | {"same_bits_beside_others": False}
    plain = {"engine": "plain", "claimed": False, "must_claim": False, "same_bits_beside_others": False}
    assert exit_status([_result(0, 0.1)], [held, plain]) == 0
    assert exit_status([_result(0, 0.1)], [moved, plain]) == 1
    assert (
        exit_status([_result(0, 0.1)], [held | {"claimed": False}, plain]) == 1
    )  # CUDA must claim
    assert (
        exit_status([_result(0, 0.1)], [held | {"claimed": False, "must_claim": False}, plain]) == 0
    )


def test_ttft_targets_read_as_the_device_check_states_them():
    assert ttft_target(LLAMA2_7B, 128, floor_s=0.002) == (0.005, "<= 5 ms")
    assert ttft_target(LLAMA2_7B, 512, floor_s=0.01) == (
        pytest.approx(0.013),
        "<= 1.3x floor",
    )
    assert ttft_target(SMOLLM2_135M, 512, floor_s=1e-4) == (0.003, "<= 3 ms")
    assert ttft_target(TINY_MHA, 64, floor_s=1e-4) == (None, "-")
    assert ttft_lengths(SMOLLM2_135M, FULL_PLAN) == [128, 512, 2048]
    assert ttft_lengths(LLAMA2_7B, FULL_PLAN) == [128, 512, 2048, 8192]


def test_forward_flops_of_the_7b_shape():
    shape = LLAMA2_7B
    # 6.48e9 non-embedding weights: 2 FLOPs each per token, plus causal attention and one LM-head row.
    expected = 2 * 6_476_005_376 * 2048 + 4 * 4096 * 32 * 2048 * 2049 / 2 + 2 * 4096 * 32000
    assert shape.forward_flops(2048) == pytest.approx(expected)
    assert leading_matches([1, 2, 3], [1, 2, 4]) == 2


def test_the_engine_imports_without_the_packages_the_gpu_image_lacks(tmp_path):
    """The default tier's guard for the smoke run below: an import of gguf or of the server's
    packages on the engine's path fails here in seconds instead of in the slow tier."""
    script = tmp_path / "import_engine.py"
    script.write_text("from firsttoken import LLM, SamplingParams\n")
    completed = subprocess.run(
        [sys.executable, "-c", _RUN_WITHOUT % str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": REPO},
        cwd=tmp_path,
    )
    assert completed.returncode == 0, completed.stderr


@pytest.mark.slow  # a subprocess that builds engines on tiny shapes (~11 s)
def test_cpu_smoke_run_prints_the_tables_and_passes(tmp_path):
    results_file = tmp_path / "results.json"
    script = os.path.join(REPO, "benchmarks", "gpu_check.py")
    completed = subprocess.run(
        [
            sys.executable,
            "-c",
            _RUN_WITHOUT % script,
            "--device",
            "cpu",
            "--tiny",
            "--json",
            str(results_file),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        cwd=tmp_path,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert "RESULT: parity ok" in completed.stdout
    results = json.loads(results_file.read_text())
    assert len(results["parity"]) == 8 and all(row["passed"] for row in results["parity"])
    assert any(row["cached_tokens"] > 0 for row in results["parity"])  # a chunk on cached context ran
    assert [row["prompt_tokens"] for row in results["ttft"]] == 2 * list(TINY_PLAN.ttft_lengths)
    assert all(row["transformers_s"] > 0 and row["meets_targets"] is None for row in results["ttft"])
    assert results["graph_capture"] == []  # no graphs on a CPU
    assert [row["batch"] for row in results["decode"]] == [1, 16, 1, 16, 1, 16, 1, 16]  # invariant, plain
    assert [row["engine"] for row in results["batch_invariance"]] == ["invariant", "plain"] * 2
    ttft_ratios = results["invariance_ttft"]
    assert [row["prompt_tokens"] for row in ttft_ratios] == 2 * list(TINY_PLAN.invariance_lengths)
    assert all(row["ratio"] > 0 for row in ttft_ratios)
