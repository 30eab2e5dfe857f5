"""The CUDA path's Triton kernels compile for a Hopper GPU on any machine (the NVIDIA backend
ships its own ptxas), so a kernel only the interpreter accepts fails here, not first on a GPU."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.skipif(importlib.util.find_spec("triton.backends.nvidia") is None, reason="no NVIDIA backend")
def test_the_kernels_compile_for_hopper_and_the_matmul_runs_on_wgmma():
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    completed = subprocess.run(
        [sys.executable, "-m", "tests.cuda.hopper_compile"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env=env | {"PYTHONPATH": REPO},
    )
    assert completed.returncode == 0, completed.stderr
    lines = completed.stdout.splitlines()
    assert lines[0].startswith("matmul: cubin") and lines[0].endswith("wgmma True")
    assert lines[1].startswith("attention: cubin")
    assert lines[2].startswith("attention with window, soft-cap and sinks: cubin")
