"""Freed activation memory is reused without page faults once malloc is tuned."""

from __future__ import annotations

import subprocess
import sys

import pytest

# Ten times: allocates and fills tensors the sizes of a prefill step's activations (61 MiB in
# all, each under glibc's mmap ceiling), then frees them; prints the page faults of the last nine.
_FAULTS_PER_REPEAT = """
import resource, sys, torch
from firsttoken.worker.host_memory import keep_freed_host_memory
if sys.argv[1] == "tuned":
    assert keep_freed_host_memory()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def step():
    live = [torch.empty(mib << 18).fill_(1.0) for mib in (4, 12, 12, 6, 24, 3)]
    del live
step()
start = faults()
for _ in range(9):
    step()
print((faults() - start) / 9)
"""


def _faults_per_repeat(mode: str) -> float:
    result = subprocess.run(
        [sys.executable, "-c", _FAULTS_PER_REPEAT, mode], capture_output=True, text=True, check=True
    )
    return float(result.stdout.strip())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_tuned_malloc_reuses_freed_pages():
    pages_per_step = (61 << 20) // 4096
    assert _faults_per_repeat("default") > pages_per_step / 2  # glibc unmaps or trims on free
    assert _faults_per_repeat("tuned") < pages_per_step / 20
