"""Device and dtype resolution: the narrow layer a new accelerator plugs into."""

from __future__ import annotations

import torch

from firsttoken.errors import InvalidInputError
from firsttoken.ops.cpu_info import cpu_flags

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    """'auto' picks CUDA, else the CPU; an explicit device that is missing is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise InvalidInputError("device", "cuda was asked for, but torch sees no CUDA device")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """'auto' is bfloat16 on accelerators and on CPUs that multiply bf16 natively
    (AVX512-BF16 or AMX), float32 on other CPUs."""
    if name == "auto":
        if device.type != "cpu":
            return torch.bfloat16
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    return _DTYPES[name]


def dtype_choice(name: str, device: torch.device) -> str:
    """Why `resolve_dtype(name, device)` gives what it gives, in a line for the start-up log."""
    dtype = str(resolve_dtype(name, device)).removeprefix("torch.")
    if name != "auto":
        return f"dtype {dtype}, as asked"
    if device.type != "cpu":
        return f"dtype auto: {dtype}, on {device.type}"
    if dtype == "bfloat16":
        return "dtype auto: bfloat16, as this CPU has bf16 dot-product instructions oneDNN uses"
    return "dtype auto: float32, as this CPU has no bf16 dot-product instructions oneDNN uses"


def cpu_has_native_bf16() -> bool:
    """Whether this CPU has bf16 dot-product instructions and oneDNN can use them."""
    flags = cpu_flags()
    has_instructions = "avx512_bf16" in flags or "amx_bf16" in flags
    return (
        has_instructions
        and torch.backends.mkldnn.is_available()
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )
