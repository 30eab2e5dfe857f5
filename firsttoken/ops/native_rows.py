"""Row kernels (csrc/row_kernels.c; the int8 sums' rescaling in csrc/w8a8_rows.c): RMSNorm with
and without its residual add, SwiGLU, rotary, greedy argmax, rescaling. A decode step spends more
time dispatching torch's small ops than computing them (RMSNorm is eight ops, rotary seven, in
every layer); each kernel here is one ctypes call, one pass over memory, split over torch's
OpenMP threads once a step is large."""

from __future__ import annotations

import torch

from firsttoken.ops.native_library import DTYPE_CODES, NativeLibrary, check, dtype_code


class RowKernels:
    """Kernels that compute each row of their output from the same row of their inputs."""

    def __init__(self, library: NativeLibrary) -> None:
        self._kernels = library.kernels

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x contiguous [rows, cols]."""
        out = torch.empty_like(x)
        rows, cols = x.shape
        check(
            self._kernels["ft_rms_norm"](
                x=x.data_ptr(), weight=weight.data_ptr(), out=out.data_ptr(), rows=rows, cols=cols, eps=eps,
                dtype=dtype_code(x), num_threads=torch.get_num_threads(),
            )
        )
        return out

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x and residual contiguous [rows, cols]; returns (normed, summed)."""
        out = torch.empty_like(x)
        summed = torch.empty_like(x)
        rows, cols = x.shape
        check(
            self._kernels["ft_add_rms_norm"](
                x=x.data_ptr(), residual=residual.data_ptr(), weight=weight.data_ptr(), out=out.data_ptr(),
                summed=summed.data_ptr(), rows=rows, cols=cols, eps=eps, dtype=dtype_code(x),
                num_threads=torch.get_num_threads(),
            )
        )
        return out, summed

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up contiguous [rows, 2 * half]."""
        rows, width = gate_up.shape
        out = gate_up.new_empty(rows, width // 2)
        check(
            self._kernels["ft_silu_and_mul"](
                gate_up=gate_up.data_ptr(), out=out.data_ptr(), rows=rows, half=width // 2,
                dtype=dtype_code(gate_up), num_threads=torch.get_num_threads(),
            )
        )
        return out

    def argmax_rows(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's `torch.argmax` (the first largest value; the first NaN where a row holds
        one) of float32 logits, contiguous [rows, vocab]: long [rows]."""
        if logits.dtype != torch.float32 or logits.dim() != 2 or not logits.is_contiguous():
            given = f"{logits.dtype} {list(logits.shape)}"
            raise ValueError(f"argmax_rows: contiguous float32 logits [rows, vocab], not {given}")
        rows, cols = logits.shape
        if cols == 0:
            raise ValueError("argmax_rows: rows of no values have no argmax")
        token_ids = torch.empty(rows, dtype=torch.long)
        check(
            self._kernels["ft_argmax_rows"](
                logits=logits.data_ptr(), token_ids=token_ids.data_ptr(), rows=rows, cols=cols,
                num_threads=torch.get_num_threads(),
            )
        )
        return token_ids

    def rescale_rows(
        self, sums: torch.Tensor, row_scales: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype
    ) -> torch.Tensor:
        """float32 sums [rows, cols] * row_scales [rows] (+ float32 bias [cols]), in `dtype`."""
        rows, cols = sums.shape
        out = torch.empty(rows, cols, dtype=dtype)
        check(
            self._kernels["ft_rescale_rows"](
                sums=sums.data_ptr(), row_scales=row_scales.data_ptr(),
                bias=bias.data_ptr() if bias is not None else None, out=out.data_ptr(), rows=rows, cols=cols,
                dtype=DTYPE_CODES[dtype], num_threads=torch.get_num_threads(),
            )
        )
        return out

    def apply_rotary_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotates x [rows, heads, head_dim] (heads contiguous, rows strided) in place;
        cos and sin contiguous [rows, 1, head_dim]."""
        rows, heads, head_dim = x.shape
        check(
            self._kernels["ft_rotary"](
                x=x.data_ptr(), row_stride=x.stride(0), rows=rows, heads=heads, head_dim=head_dim,
                cos=cos.data_ptr(), sin=sin.data_ptr(), dtype=dtype_code(x),
                num_threads=torch.get_num_threads(),
            )
        )
        return x
