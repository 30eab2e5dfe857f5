"""The compiled kernels' library as every group of kernels (`firsttoken.ops.native`) calls it: its
functions bound by name, what its build targets, and the tensor and status conventions they share."""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from firsttoken.ops import native_abi

DTYPE_CODES = {torch.float32: native_abi.DTYPE_FLOAT32, torch.bfloat16: native_abi.DTYPE_BFLOAT16}


def supports(tensor: torch.Tensor) -> bool:
    """Whether the kernels take this tensor's device and dtype."""
    return tensor.device.type == "cpu" and tensor.dtype in DTYPE_CODES


def heads_contiguous(x: torch.Tensor) -> bool:
    """x [rows, heads, head_dim] with each row's heads one contiguous run (rows may be strided),
    the layout every kernel here reads per-head tensors in."""
    return x.stride(2) == 1 and x.stride(1) == x.shape[2]


def dtype_code(tensor: torch.Tensor) -> int:
    return DTYPE_CODES[tensor.dtype]


def check(
    status: int,
    out_of_bounds: str = "native kernel: an index lies outside its tensor",
    bad_shape: str = "native kernel: a shape it does not take",
) -> None:
    """Raises for a kernel's failure status: IndexError (`out_of_bounds` says what lay outside),
    ValueError (`bad_shape`) or MemoryError."""
    if status == native_abi.Status.OUT_OF_BOUNDS:
        raise IndexError(out_of_bounds)
    if status == native_abi.Status.BAD_SHAPE:
        raise ValueError(bad_shape)
    if status == native_abi.Status.OUT_OF_MEMORY:
        raise MemoryError("native kernel: could not allocate its scratch memory or start its threads")


# Compared and hashed as the one loaded library it is, not by its bound functions.
@dataclass(frozen=True, eq=False)
class NativeLibrary:
    """Every kernel of `native_abi.KERNELS` a loaded build holds, called with its parameters by
    name, and what the build targets."""

    kernels: Mapping[str, Callable[..., int | bytes]]
    # What the build targets: avx2, avx512, avx512_bf16 (+amx), neon or generic.
    isa: str
    # Whether the OS lets the process use AMX tile registers.
    has_amx: bool

    @classmethod
    def bind(cls, library: ctypes.CDLL) -> NativeLibrary:
        kernels = {
            kernel.name: kernel.bind(library)
            for kernel in native_abi.KERNELS
            if kernel.requires is native_abi.Requires.ANY_ISA or hasattr(library, kernel.name)
        }
        # Asks the OS for the tile registers once for the process, as oneDNN does.
        has_amx = "ft_amx_available" in kernels and bool(kernels["ft_amx_available"]())
        return cls(kernels, kernels["ft_isa_name"]().decode(), has_amx)

    @property
    def has_decode_kernels(self) -> bool:
        """Whether the build holds the AVX512-BF16 decode kernels: int4 and int8 projections,
        paged decode attention and the whole int4 decode step."""
        return "ft_decode_step" in self.kernels
