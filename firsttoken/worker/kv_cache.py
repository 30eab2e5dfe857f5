"""Sizes the paged KV cache from a memory budget and allocates its tensors."""

from __future__ import annotations

import os

import numpy as np
import torch

from firsttoken.config import CacheConfig
from firsttoken.errors import InvalidInputError
from firsttoken.models.arch import ModelArch


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


def num_kv_blocks(config: CacheConfig, arch: ModelArch, dtype: torch.dtype, device: torch.device) -> int:
    """Blocks that fit the memory budget."""
    budget = config.kv_cache_memory_bytes
    if budget is None:
        fraction = config.kv_cache_memory_fraction if device.type == "cpu" else config.gpu_memory_utilization
        budget = int(available_memory_bytes(device) * fraction)
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

    Zeroed, so that a padded read of a never-written slot is finite. On the CPU the zeros come
    from calloc'd pages that the kernel maps lazily: start-up does not touch gigabytes, and
    memory is committed only as blocks are first written.
    """
    shape = (2, num_blocks, block_size, arch.num_kv_heads, arch.head_dim)
    if device.type != "cpu":
        return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(arch.num_layers)]
    element_size = torch.tensor([], dtype=dtype).element_size()
    num_bytes = element_size * 2 * num_blocks * block_size * arch.num_kv_heads * arch.head_dim
    return [
        torch.from_numpy(np.zeros(num_bytes, dtype=np.uint8)).view(dtype).view(shape)
        for _ in range(arch.num_layers)
    ]
