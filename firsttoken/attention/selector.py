"""The one place an attention backend is chosen, from the device and the attention config."""

from __future__ import annotations

import torch

from firsttoken.attention.backend import AttentionBackend
from firsttoken.attention.cpu_backend import FLASH_MAX_QUERIES_BESIDE_SDPA, CPUAttentionBackend
from firsttoken.config import AttentionConfig
from firsttoken.ops.native import NativeKernels


def select_attention_backend(
    config: AttentionConfig,
    device: torch.device,
    num_heads: int,
    num_kv_heads: int,
    native_kernels: NativeKernels | None = None,
    batch_invariant: bool = False,
    plain_attention: bool = True,
    flash_max_queries: int | None = FLASH_MAX_QUERIES_BESIDE_SDPA,
) -> AttentionBackend:
    """cuda: SDPA flash prefills plus Triton paged attention, or when `batch_invariant` every
    row on the Triton chunk kernel (fresh prefills and decodes too); cpu: the native kernels
    when given, else SDPA, whose decode rows take the prefill kernel's arithmetic when
    `batch_invariant`. Without `plain_attention` (some layer has a window, soft-capped scores or
    sinks, which SDPA lacks) cuda pages every prefill too. On the CPU, prefill spans of more than
    `flash_max_queries` tokens (None: no limit) take SDPA where SDPA may compute them."""
    if device.type == "cuda":
        if config.backend == "sdpa":
            raise ValueError("attention_backend: sdpa runs on the CPU; on cuda choose auto or triton")
        try:
            from firsttoken.attention.cuda_backend import CudaAttentionBackend
        except ModuleNotFoundError as error:
            if error.name != "triton":
                raise
            raise ValueError(
                "device: cuda needs the triton package (pip install 'firsttoken[cuda]')"
            ) from error
        return CudaAttentionBackend(
            device,
            num_heads,
            num_kv_heads,
            paged_prefills=batch_invariant or not plain_attention,
            decodes_as_chunks=batch_invariant,
        )
    if config.backend == "triton":
        raise ValueError(f"attention_backend: triton needs device cuda, not {device.type}")
    return CPUAttentionBackend(
        device, native_kernels, decode_as_prefill=batch_invariant, flash_max_queries=flash_max_queries
    )
