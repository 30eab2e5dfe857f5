"""Sizes the paged KV cache from a memory budget, allocates its tensors and, on request,
writes them once at start."""

from __future__ import annotations

import logging
import mmap
import os
import time

import numpy as np
import torch

from firsttoken.config import CacheConfig
from firsttoken.errors import InvalidInputError
from firsttoken.models.arch import ModelArch

logger = logging.getLogger(__name__)


def bytes_per_block(arch: ModelArch, block_size: int, dtype: torch.dtype) -> int:
    """K and V of every layer for one block of tokens."""
    element_size = torch.tensor([], dtype=dtype).element_size()
    return 2 * arch.num_layers * block_size * arch.num_kv_heads * arch.head_dim * element_size


def available_memory_bytes(device: torch.device) -> int:
    if device.type != "cpu":
        free, _total = torch.get_device_module(device).mem_get_info(device)
        return free
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def num_kv_blocks(
    config: CacheConfig, arch: ModelArch, dtype: torch.dtype, device: torch.device, kv_share: float = 1.0
) -> int:
    """Blocks that fit the memory budget. On the CPU the tensor-parallel ranks share one budget:
    each takes its `kv_share` of it (its KV heads' part); an accelerator's is its own."""
    budget = config.kv_cache_memory_bytes
    if budget is None:
        fraction = config.kv_cache_memory_fraction if device.type == "cpu" else config.gpu_memory_utilization
        budget = int(available_memory_bytes(device) * fraction)
    if device.type == "cpu" and kv_share < 1.0:
        budget = max(1, int(budget * kv_share))
    per_block = bytes_per_block(arch, config.block_size, dtype)
    num_blocks = budget // per_block
    if num_blocks < 1:
        raise InvalidInputError(
            "kv_cache_memory_bytes", f"{budget} bytes hold no KV block; one block needs {per_block} bytes"
        )
    return int(num_blocks)


def allocate_kv_caches(
    arch: ModelArch, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor]:
    """One [2, num_blocks, block_size, kv_heads, head_dim] tensor per layer.

    Zeroed, so that a padded read of a never-written slot is finite. On the CPU the zeros are
    anonymous mappings of their own, which the kernel fills lazily: start-up does not touch
    gigabytes, and memory is committed only as blocks are first written. (A calloc would not
    do: once `keep_freed_host_memory` has tuned malloc, a block that large comes from a heap
    that earlier engines in the process used, and calloc writes every byte of it.)
    """
    shape = (2, num_blocks, block_size, arch.num_kv_heads, arch.head_dim)
    if device.type != "cpu":
        return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(arch.num_layers)]
    element_size = torch.tensor([], dtype=dtype).element_size()
    num_bytes = element_size * 2 * num_blocks * block_size * arch.num_kv_heads * arch.head_dim
    return [_lazily_zeroed_bytes(num_bytes).view(dtype).view(shape) for _ in range(arch.num_layers)]


def _lazily_zeroed_bytes(num_bytes: int) -> torch.Tensor:
    """A uint8 tensor over a private anonymous mapping; unmapped when the tensor is freed (the
    numpy array it shares memory with holds the mapping)."""
    mapping = mmap.mmap(-1, num_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.from_numpy(np.frombuffer(mapping, dtype=np.uint8))


def prefault_kv_caches(kv_caches: list[torch.Tensor]) -> None:
    """Write the whole KV cache once, so its pages are mapped before requests arrive.

    On the CPU the cache starts as lazily mapped zero pages (see `allocate_kv_caches`). With
    the prompt cache on, finished requests keep their blocks cached and new ones take
    never-written blocks, so every prompt would pay the page faults of its KV until the whole
    cache had been written once. A server pays that once at start instead, on torch's threads."""
    started = time.perf_counter()
    with torch.inference_mode():
        for cache in kv_caches:
            cache.zero_()
    num_blocks = kv_caches[0].shape[1]  # [2, num_blocks, block_size, kv_heads, head_dim]
    logger.info("wrote the %d-block KV cache in %.2f s", num_blocks, time.perf_counter() - started)
