"""The W8A8 projection, `W8A8Linear`, beside its plain reference: each step's rows quantized to
int8 on the way in, multiplied by the int8 weights in int32 (oneDNN's int8 matmul or the native
one), rescaled in float. The scheme, its weights and where it runs: `firsttoken.ops.w8a8`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from firsttoken.ops import native, native_library
from firsttoken.ops.hadamard import check_hadamard_block
from firsttoken.ops.w8a8 import (
    ACTIVATION_ZERO_POINT,
    SMOOTHING_ALPHA,
    no_zero_points,
    onednn_int8_matmul,
    quantize_int8,
    quantize_rows,
    smoothing_factors,
    w8a8_on_native_matmul,
)


def w8a8_linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scales: torch.Tensor,
    bias: torch.Tensor | None,
    input_scales: torch.Tensor | None = None,
    hadamard_block: int = 1,
) -> torch.Tensor:
    """The same quantized product in float64 from the integer levels: what `W8A8Linear` computes,
    up to the float32 roundings of its rescaling."""
    flat = x.reshape(-1, x.shape[-1])
    levels, row_scales = quantize_rows(flat, input_scales, hadamard_block)
    sums = (levels.to(torch.int64) - ACTIVATION_ZERO_POINT) @ weight.to(torch.int64).t()
    output = sums.double() * weight_scales.double()[None, :] * row_scales.double()[:, None]
    if bias is not None:
        output = output + bias.double()
    return output.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])


def rescale_rows(
    sums: torch.Tensor, row_scales: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """float32 sums [rows, out] (already times the weight scales) times each row's activation
    scale, plus the float32 bias, in `dtype`."""
    output = sums.mul_(row_scales[:, None])
    if bias is not None:
        output.add_(bias)
    return output.to(dtype)


@dataclass
class PendingNorm:
    """rms_norm(x + residual) (of x where residual is None) not run yet: the W8A8 projection
    that takes it runs the norm inside its own quantization pass, so the normed rows are never
    written, and leaves x + residual (x) in `summed`, as `add_rms_norm` returns it."""

    x: torch.Tensor
    residual: torch.Tensor | None
    weight: torch.Tensor
    eps: float
    summed: torch.Tensor | None = None


class W8A8Linear(nn.Module):
    """y = x W^T (+ b) with int8 weights (packed once for oneDNN, or for the native int8 matmul
    where oneDNN's sums are not exact) and each step's rows quantized to int8 on the way in
    (after `input_scales`, SmoothQuant's 1 / s, where given, or turned by the Walsh-Hadamard
    transform in blocks of `hadamard_block` where above 1: a rotated model's down_proj, whose
    W holds the transform's inverse); computes in int32, returns the input's dtype. With native
    kernels the quantization and the rescaling are one pass each (in torch ops they are eight
    passes, which cost more than the matmul itself: 2048 rows, 120 projections, 330 ms against
    131 ms).

    `swiglu_output`: the rows are SwiGLU's gate | up halves; where the native int8 matmul can
    (`makes_swiglu_product`), it returns silu(gate) * up [.., out / 2] (`silu_and_mul`'s bits)
    from its epilogue, so gate | up is never written out nor read back."""

    def __init__(
        self,
        weight: torch.Tensor,
        weight_scales: torch.Tensor,
        bias: torch.Tensor | None,
        kernels: native.NativeKernels | None = None,
        input_scales: torch.Tensor | None = None,
        hadamard_block: int = 1,
        swiglu_output: bool = False,
    ) -> None:
        super().__init__()
        check_hadamard_block(weight.shape[1], hadamard_block)
        self.native_matmul = w8a8_on_native_matmul(kernels)
        self.makes_swiglu_product = (
            swiglu_output
            and self.native_matmul
            and kernels.w8a8.w8a8_matmul_makes_swiglu
            and weight.shape[0] % 2 == 0
        )
        self.out_features = weight.shape[0] // 2 if self.makes_swiglu_product else weight.shape[0]
        if self.native_matmul:
            packed = kernels.w8a8.pack_w8a8_weight(weight, silu_gated=self.makes_swiglu_product)
        else:
            packed = torch.ops.onednn.qlinear_prepack(weight, None)
        self.register_buffer("packed_weight", packed)
        self.register_buffer("weight_scales", weight_scales.float().contiguous())
        self.register_buffer("weight_zero_points", no_zero_points(weight.shape[0]))
        self.bias = bias.float().contiguous() if bias is not None else None
        self.input_scales = input_scales.float().contiguous() if input_scales is not None else None
        self.hadamard_block = hadamard_block
        self.kernels = kernels

    @classmethod
    def from_float(
        cls,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        kernels: native.NativeKernels | None = None,
        activation_max: torch.Tensor | None = None,
        hadamard_block: int = 1,
        swiglu_output: bool = False,
    ) -> W8A8Linear:
        """`activation_max` [in]: the inputs' per-channel maxima from a calibration run, which
        smooth the weight and its inputs (SMOOTHING_ALPHA); None quantizes them as they are.
        `hadamard_block`, `swiglu_output`: see the class."""
        if activation_max is None:
            return cls(
                *quantize_int8(weight), bias, kernels,
                hadamard_block=hadamard_block, swiglu_output=swiglu_output,
            )
        factors = smoothing_factors(activation_max, weight, SMOOTHING_ALPHA)
        return cls(
            *quantize_int8(weight.float() * factors), bias, kernels, input_scales=1 / factors,
            swiglu_output=swiglu_output,
        )

    @property
    def takes_silu_gated_inputs(self) -> bool:
        """Whether `forward_silu_gated` runs here: its quantization pass is native."""
        return self.kernels is not None

    def takes_normed_rows(
        self, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor
    ) -> bool:
        """Whether this projection takes these rows' norm pending (a PendingNorm): native
        kernels, rows they take."""
        tensors = (x, norm_weight) if residual is None else (x, residual, norm_weight)
        return (
            self.kernels is not None
            and x.dim() == 2
            and all(
                native_library.supports(tensor) and tensor.dtype == x.dtype and tensor.is_contiguous()
                for tensor in tensors
            )
        )

    def forward(self, x: torch.Tensor | PendingNorm) -> torch.Tensor:
        """`x` a PendingNorm only where `takes_normed_rows` said so."""
        if isinstance(x, PendingNorm):
            return self._project_normed(x)
        return self._project(x, silu_gated=False)

    def forward_silu_gated(self, gate_up: torch.Tensor) -> torch.Tensor:
        """SwiGLU's down projection: self(silu_and_mul(gate_up)) with the same bits, the product
        made and rounded to the dtype inside the quantization pass, so it is never written out."""
        if not self.takes_silu_gated_inputs:
            raise ValueError("forward_silu_gated needs the native kernels' quantization pass")
        return self._project(gate_up, silu_gated=True)

    def _project_normed(self, norm: PendingNorm) -> torch.Tensor:
        """The product of the norm's rows, quantized in the norm's own pass (the levels this
        projection's quantization pass would make of them), the norm's `summed` set."""
        if self.native_matmul:
            output, norm.summed = self.kernels.w8a8.w8a8_norm_matmul(
                norm.x, norm.residual, norm.weight, norm.eps, self.packed_weight, self.weight_scales,
                self.bias, self.input_scales, self.hadamard_block, self.makes_swiglu_product,
            )
            return output
        levels, row_scales, norm.summed = self.kernels.w8a8.rms_norm_quantize_int8(
            norm.x, norm.residual, norm.weight, norm.eps, self.input_scales, self.hadamard_block
        )
        return self._multiply(levels, row_scales, norm.x.dtype)

    def _project(self, x: torch.Tensor, silu_gated: bool) -> torch.Tensor:
        flat = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        if self.native_matmul:
            # One native call: the quantization pass and the matmul back to back.
            output = self.kernels.w8a8.w8a8_quantize_matmul(
                flat.contiguous(), self.packed_weight, self.weight_scales, self.bias, self.input_scales,
                self.hadamard_block, silu_gated, self.makes_swiglu_product,
            )
            return output if x.dim() == 2 else output.reshape(*x.shape[:-1], self.out_features)
        if self.kernels is not None:
            levels, row_scales = self.kernels.w8a8.quantize_rows_int8(
                flat.contiguous(), self.input_scales, self.hadamard_block, silu_gated
            )
        else:
            levels, row_scales = quantize_rows(flat, self.input_scales, self.hadamard_block)
        output = self._multiply(levels, row_scales, x.dtype)
        return output if x.dim() == 2 else output.reshape(*x.shape[:-1], self.out_features)

    def _multiply(self, levels: torch.Tensor, row_scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[rows, out] in `dtype` from the quantized rows."""
        if self.native_matmul:
            return self.kernels.w8a8.w8a8_matmul(
                levels, row_scales, self.packed_weight, self.weight_scales, self.bias, dtype,
                silu_gated=self.makes_swiglu_product,
            )
        sums = onednn_int8_matmul(
            levels, self.packed_weight, self.weight_scales, self.weight_zero_points, ACTIVATION_ZERO_POINT
        )
        if self.kernels is not None:
            return self.kernels.rows.rescale_rows(sums, row_scales, self.bias, dtype)
        return rescale_rows(sums, row_scales, self.bias, dtype)
