"""int4 and int8 projections for decode-sized steps: on AVX512-BF16 (csrc/quantized_matmul_bf16.c)
and their portable siblings for every build, float32 or bf16 (csrc/quantized_matmul.c)."""

from __future__ import annotations

import torch

from firsttoken.ops import native_abi
from firsttoken.ops.native_library import DTYPE_CODES, NativeLibrary, check, dtype_code


def _quantized_weight(
    kind: str, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
) -> dict[str, int | None]:
    """The weight parameters of the `kind` ("int4" or "int8") projection kernels."""
    bias_pointer = None if bias is None else bias.data_ptr()
    if kind == "int4":
        return {"levels": weight.data_ptr(), "scales_zeros": scales.data_ptr(), "bias": bias_pointer}
    return {"weight": weight.data_ptr(), "scales": scales.data_ptr(), "bias": bias_pointer}


class QuantizedMatmulKernels:
    """Products of up to `native_abi.DECODE_MAX_ROWS` rows with int4 or int8 weights."""

    def __init__(self, library: NativeLibrary) -> None:
        self._kernels = library.kernels

    def int4_matmul(
        self, levels: torch.Tensor, scales_zeros: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor
    ) -> torch.Tensor:
        """x [rows, in] . W^T for rows <= `native_abi.DECODE_MAX_ROWS`, in a multiple of 64, all
        bf16 and contiguous; W in the layout of `firsttoken.ops.quantized_linear.pack_int4`: levels uint8
        [out, in / 2], scales_zeros [out, 2 * in / 32]."""
        return self._quantized_matmul(
            "int4", levels, scales_zeros, bias, x, 2 * levels.shape[1], native_abi.INT4_INPUT_MULTIPLE
        )

    def int8_matmul(
        self, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor
    ) -> torch.Tensor:
        """x [rows, in] . (scales * W)^T for int8 W [out, in] (in a multiple of 16), rows <=
        `native_abi.DECODE_MAX_ROWS`; x, scales [out] and bias bf16; all contiguous."""
        return self._quantized_matmul(
            "int8", weight, scales, bias, x, weight.shape[1], native_abi.INT8_INPUT_MULTIPLE
        )

    def portable_int4_matmul(
        self, levels: torch.Tensor, scales_zeros: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor
    ) -> torch.Tensor:
        """x [rows, in] . W^T (+ bias) on any ISA, rows <= `native_abi.DECODE_MAX_ROWS`, in a
        multiple of 32; x and bias float32 or bf16 (one dtype, the output's), all contiguous; W
        in the layout of `firsttoken.ops.quantized_linear.pack_int4` (scales_zeros bf16)."""
        return self._portable_matmul(
            "int4", levels, scales_zeros, bias, x, 2 * levels.shape[1],
            native_abi.PORTABLE_INT4_INPUT_MULTIPLE,
        )

    def portable_int8_matmul(
        self, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor
    ) -> torch.Tensor:
        """x [rows, in] . (scales * W)^T (+ bias) on any ISA for int8 W [out, in] (in a multiple
        of 16), rows <= `native_abi.DECODE_MAX_ROWS`; x, scales [out] and bias float32 or bf16 (one
        dtype, the output's), all contiguous."""
        if scales.dtype != x.dtype:
            raise ValueError(f"portable_int8_matmul: scales in {scales.dtype}, inputs in {x.dtype}")
        return self._portable_matmul(
            "int8", weight, scales, bias, x, weight.shape[1], native_abi.INT8_INPUT_MULTIPLE
        )

    def _portable_matmul(
        self,
        kind: str,
        weight: torch.Tensor,
        scales: torch.Tensor,
        bias: torch.Tensor | None,
        x: torch.Tensor,
        weight_inputs: int,
        input_multiple: int,
    ) -> torch.Tensor:
        name = f"portable_{kind}_matmul"
        rows, in_features = x.shape
        takes_rows = 1 <= rows <= native_abi.DECODE_MAX_ROWS
        if (
            not takes_rows
            or weight_inputs != in_features
            or in_features % input_multiple
            or x.dtype not in DTYPE_CODES
        ):
            raise ValueError(
                f"{name}: {rows} rows of {in_features} {x.dtype} inputs for weights {tuple(weight.shape)}"
            )
        if bias is not None and bias.dtype != x.dtype:
            raise ValueError(f"{name}: bias in {bias.dtype}, inputs in {x.dtype}")
        out_features = weight.shape[0]
        out = x.new_empty(rows, out_features)
        check(
            self._kernels[f"ft_{name}"](
                **_quantized_weight(kind, weight, scales, bias), out_features=out_features,
                in_features=in_features, x=x.data_ptr(), rows=rows, out=out.data_ptr(), dtype=dtype_code(x),
                num_threads=torch.get_num_threads(),
            )
        )
        return out

    def _quantized_matmul(
        self,
        kind: str,
        weight: torch.Tensor,
        scales: torch.Tensor,
        bias: torch.Tensor | None,
        x: torch.Tensor,
        weight_inputs: int,
        input_multiple: int,
    ) -> torch.Tensor:
        name = f"{kind}_matmul"
        rows, in_features = x.shape
        takes_rows = 1 <= rows <= native_abi.DECODE_MAX_ROWS
        if not takes_rows or weight_inputs != in_features or in_features % input_multiple:
            raise ValueError(f"{name}: {rows} rows of {in_features} inputs for weights {tuple(weight.shape)}")
        out_features = weight.shape[0]
        out = x.new_empty(rows, out_features)
        check(
            self._kernels[f"ft_{name}"](
                **_quantized_weight(kind, weight, scales, bias), out_features=out_features,
                in_features=in_features, x=x.data_ptr(), rows=rows, out=out.data_ptr(),
                num_threads=torch.get_num_threads(),
            )
        )
        return out
