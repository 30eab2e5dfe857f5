"""Device and dtype resolution: the narrow layer a new accelerator plugs into."""

from __future__ import annotations

import importlib.util
import os

import torch

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
    flags = _cpu_flags()
    has_instructions = "avx512_bf16" in flags or "amx_bf16" in flags
    return has_instructions and torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="ascii") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return set(line.partition(":")[2].split())
    except OSError:
        pass
    return set()


def physical_core_count() -> int:
    """Cores this process may run on, counting hyperthread siblings once."""
    allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        with open("/proc/cpuinfo", encoding="ascii") as cpuinfo:
            cores = set()
            physical_id = core_id = None
            for line in cpuinfo:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "physical id":
                    physical_id = value.strip()
                elif key == "core id":
                    core_id = value.strip()
                    cores.add((physical_id, core_id))
        if cores:
            return max(1, min(allowed, len(cores)))
    except OSError:
        pass
    return max(1, allowed)
