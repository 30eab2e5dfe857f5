"""Device and dtype resolution: the narrow layer a new accelerator plugs into."""

from __future__ import annotations

import importlib.util

import torch

from firsttoken.ops.cpu_info import cpu_flags
# Re-exported: the engine sizes torch's thread pool by it.
from firsttoken.ops.cpu_info import physical_core_count as physical_core_count

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    """'auto' picks CUDA, then NPU, then CPU; an explicit device that is missing is an error."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if _npu_available():
            return torch.device("npu")
        return torch.device("cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: cuda was asked for, but torch sees no CUDA device")
    if name == "npu":
        if importlib.util.find_spec("torch_npu") is None:
            raise ValueError("device: npu needs the torch_npu package, which is not installed")
        if not _npu_available():
            raise ValueError("device: npu was asked for, but torch_npu sees no NPU")
    return torch.device(name)


def _npu_available() -> bool:
    if importlib.util.find_spec("torch_npu") is None:
        return False
    import torch_npu  # noqa: F401  (registers torch.npu)

    return bool(torch.npu.is_available())


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """'auto' is bfloat16 on accelerators and on CPUs that multiply bf16 natively
    (AVX512-BF16 or AMX), float32 on other CPUs."""
    if name == "auto":
        if device.type != "cpu":
            return torch.bfloat16
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    return _DTYPES[name]


def cpu_has_native_bf16() -> bool:
    """Whether this CPU has bf16 dot-product instructions and oneDNN can use them."""
    flags = cpu_flags()
    has_instructions = "avx512_bf16" in flags or "amx_bf16" in flags
    return has_instructions and torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
