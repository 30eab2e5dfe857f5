"""Freed activation memory stays in malloc's heap for the next step once malloc is tuned.

Asserted through glibc's own accounting (mmapped bytes, the heap's end), not page-fault counts:
the kernel also counts faults it causes itself (NUMA balancing, page migration), so a fault count
depends on the host (a CI host measured 1,191 per step where this one measures 0).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import subprocess
import sys

import pytest

# Thirty steps, each allocating and filling tensors the sizes of a prefill step's activations
# (145 MiB in all, each under glibc's mmap ceiling), then freeing them. Prints, per step, the
# bytes glibc served by mmap while the tensors lived and where the heap ended then and after the
# free (a lower end after the free: glibc trimmed the heap, and the next step faults it back in).
_HEAP_ACCOUNTING = """
import ctypes, ctypes.util, json, sys, torch
from firsttoken.worker.host_memory import keep_freed_host_memory
class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.mallinfo2.restype = MallInfo2
libc.sbrk.restype = ctypes.c_void_p
libc.sbrk.argtypes = [ctypes.c_ssize_t]
if sys.argv[1] == "tuned":
    assert keep_freed_host_memory()
SIZES_MIB = (4, 24, 12, 24, 6, 24, 24, 3, 24)
mmapped_before = libc.mallinfo2().hblkhd
steps = []
for _ in range(30):
    live = [torch.empty(mib << 18).fill_(1.0) for mib in SIZES_MIB]
    mmapped_while_live = libc.mallinfo2().hblkhd - mmapped_before
    heap_end_while_live = libc.sbrk(0)
    del live
    steps.append({
        "mmapped_while_live": mmapped_while_live,
        "heap_end_while_live": heap_end_while_live,
        "heap_end_after_free": libc.sbrk(0),
    })
print(json.dumps(steps))
"""


_STEP_BYTES = 145 << 20


def _has_glibc_accounting() -> bool:
    library = ctypes.util.find_library("c")
    if library is None:
        return False
    libc = ctypes.CDLL(library)
    return all(hasattr(libc, name) for name in ("mallopt", "mallinfo2", "sbrk"))


def _heap_accounting(mode: str) -> list[dict[str, int]]:
    result = subprocess.run(
        [sys.executable, "-c", _HEAP_ACCOUNTING, mode], capture_output=True, text=True, check=True
    )
    return json.loads(result.stdout)


needs_glibc = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not _has_glibc_accounting(),
    reason="glibc's mallopt, mallinfo2 and sbrk",
)


@needs_glibc
def test_tuned_malloc_serves_every_step_from_a_heap_it_never_trims():
    steps = _heap_accounting("tuned")
    assert [step["mmapped_while_live"] for step in steps] == [0] * len(steps)
    assert all(step["heap_end_after_free"] == step["heap_end_while_live"] for step in steps)
    # Reuse, not growth: after the first step the heap grows by less than one more step's bytes.
    assert steps[-1]["heap_end_after_free"] - steps[0]["heap_end_after_free"] < _STEP_BYTES


@needs_glibc
def test_default_malloc_hands_the_first_steps_memory_back():
    # The behaviour the tuning exists to change: glibc's default mmaps the first step's large
    # tensors and unmaps them on free. (Whether it then trims the heap after later steps depends
    # on what else the process allocated above them: not asserted.)
    steps = _heap_accounting("default")
    assert steps[0]["mmapped_while_live"] > 0
