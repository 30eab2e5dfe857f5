"""Host memory: keep the memory a step frees for the next step instead of returning it.

A prefill step allocates and frees tens of megabytes of activations. glibc serves blocks that
large with fresh mmaps and hands them back to the kernel on free, so every step pays a page
fault (and the kernel's zeroing) for each 4 KiB it touches: ~35,000 faults per 2048-token
prompt of the default model. Raising the mmap threshold to glibc's maximum and disabling heap
trimming lets the heap keep its high-water mark, and later steps reuse mapped pages.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc's ceiling for M_MMAP_THRESHOLD on 64-bit (HEAP_MAX_SIZE / 2).
_MAX_MMAP_THRESHOLD = 32 << 20
# The largest value mallopt takes (a C int): in practice, never trim.
_TRIM_THRESHOLD = 2**31 - 1


def keep_freed_host_memory() -> bool:
    """Tune glibc's malloc as above; False (and nothing changed) where libc has no mallopt."""
    library = ctypes.util.find_library("c")
    if library is None:
        return False
    libc = ctypes.CDLL(library)
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    trim_ok = mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)
    mmap_ok = mallopt(_M_MMAP_THRESHOLD, _MAX_MMAP_THRESHOLD)
    if not (trim_ok and mmap_ok):
        logger.debug("mallopt refused the host-memory settings")
        return False
    return True
