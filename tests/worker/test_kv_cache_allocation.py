"""A CPU KV cache is committed as its blocks are written, never at allocation, also where an
engine before it in the process left malloc's heap holding freed memory."""

from __future__ import annotations

import subprocess
import sys

import pytest

# Allocates, frees and reallocates a 480 MiB KV cache (30 layers of 16 MiB, each under the mmap
# threshold that `keep_freed_host_memory` sets, so a malloc'd cache would come from the heap)
# and prints the resident bytes the second allocation added.
_RESIDENT_GROWTH = """
import gc, os, torch
from firsttoken.models.arch import ModelArch
from firsttoken.worker.host_memory import keep_freed_host_memory
from firsttoken.worker.kv_cache import allocate_kv_caches

def resident_bytes():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

keep_freed_host_memory()
arch = ModelArch(architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                 num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5,
                 rope_theta=1e5, max_position_embeddings=8192, tie_word_embeddings=True,
                 attention_bias=False)
num_blocks = (16 << 20) // (2 * 16 * 3 * 64 * 4)
caches = allocate_kv_caches(arch, num_blocks, 16, torch.float32, torch.device("cpu"))
for cache in caches:
    cache[:, :1].fill_(1.0)
del caches
gc.collect()
before = resident_bytes()
caches = allocate_kv_caches(arch, num_blocks, 16, torch.float32, torch.device("cpu"))
print(resident_bytes() - before)
assert all(bool((cache[:, -1] == 0).all()) for cache in caches)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_a_second_kv_cache_in_a_tuned_process_is_not_written_at_allocation():
    result = subprocess.run(
        [sys.executable, "-c", _RESIDENT_GROWTH], capture_output=True, text=True, check=True
    )
    kv_cache_bytes = 30 * (16 << 20)
    assert int(result.stdout) < kv_cache_bytes // 10
