"""Weight-only int8 and int4 projections, each beside its plain reference.

Decoding on a CPU reads every weight once per step, so its speed is bound by the bytes of the
weights: int8 weights (per-output-channel scales) halve what bf16 reads, int4 (groups of 32
with a scale and a zero each) quarter it. The quantized matmuls are PyTorch's own CPU kernels,
on CPUs with AVX512-BF16 our own for bf16 (`NativeInt4Linear`, and `Int8Linear` for decode-
sized steps), and for float32 activations on any CPU our portable ones (`PortableInt4Linear`,
`Int8Linear`); each plain reference dequantizes. Which of them serves a projection, and for
which steps: `firsttoken.ops.linear_choice`.
"""

from __future__ import annotations

from typing import Self

import torch
import torch.nn.functional as F
from torch import nn

from firsttoken.ops import native, native_abi
from firsttoken.ops.native_abi import INT4_GROUP_SIZE
from firsttoken.ops.w8a8 import quantize_int8


def int8_linear_reference(
    x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    dequantized = (weight.float() * scales.float()[:, None]).to(x.dtype)
    return F.linear(x, dequantized, bias)


class Int8Linear(nn.Module):
    """Weight-only int8 projection; built from a loaded float Linear. With native kernels,
    steps of up to `native_abi.DECODE_MAX_ROWS` rows take ours: bf16 ones the AVX512-BF16 int8
    kernel (the same weights, scales and bf16 roundings as torch's), float32 ones the portable
    kernel (see `linear_choice.PORTABLE_QUANTIZED_MAX_ROWS`)."""

    def __init__(
        self,
        weight: torch.Tensor,
        scales: torch.Tensor,
        bias: torch.Tensor | None,
        kernels: native.NativeKernels | None = None,
    ) -> None:
        super().__init__()
        self.register_buffer("weight", weight)
        self.register_buffer("scales", scales)
        self.bias = bias
        takes_native = kernels is not None and weight.shape[1] % native_abi.INT8_INPUT_MULTIPLE == 0
        self.kernels = kernels if takes_native and weight.device.type == "cpu" else None

    @classmethod
    def from_float(
        cls, weight: torch.Tensor, bias: torch.Tensor | None, kernels: native.NativeKernels | None = None
    ) -> Int8Linear:
        quantized, scales = quantize_int8(weight)
        return cls(
            quantized.to(weight.device), scales.to(device=weight.device, dtype=weight.dtype), bias, kernels
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu":
            return int8_linear_reference(x, self.weight, self.scales, self.bias)
        leading = x.shape[:-1]
        flat = x.reshape(-1, x.shape[-1])
        if self._native_takes(flat):
            output = self.kernels.quantized.int8_matmul(
                self.weight, self.scales, self.bias, flat.contiguous()
            )
            return output.reshape(*leading, -1)
        if self.runs_portable and flat.shape[0] <= native_abi.DECODE_MAX_ROWS and flat.dtype == torch.float32:
            output = self.kernels.quantized.portable_int8_matmul(
                self.weight, self.scales, self.bias, flat.contiguous()
            )
            return output.reshape(*leading, -1)
        output = torch.ops.aten._weight_int8pack_mm(flat, self.weight, self.scales)
        if self.bias is not None:
            output = output + self.bias
        return output.reshape(*leading, -1)

    @property
    def runs_portable(self) -> bool:
        """Whether float32 decode steps take the portable kernel (float32 scales and bias)."""
        return (
            self.kernels is not None and self.scales.dtype == torch.float32
            and (self.bias is None or self.bias.dtype == torch.float32)
        )

    def _native_takes(self, flat: torch.Tensor) -> bool:
        return (
            self.kernels is not None
            and self.kernels.has_decode_kernels
            and flat.shape[0] <= native_abi.DECODE_MAX_ROWS
            and flat.dtype == self.scales.dtype == torch.bfloat16
            and (self.bias is None or self.bias.dtype == torch.bfloat16)
        )


def quantize_int4(
    weight: torch.Tensor, group_size: int = INT4_GROUP_SIZE
) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric group-wise 4-bit: (levels int32 [out, in] in 0..15, float32 scales_and_zeros
    [in / group_size, out, 2]) with W ~ (levels - 8) * scale + zero, PyTorch's int4 convention."""
    out_features, in_features = weight.shape
    groups = weight.float().view(out_features, in_features // group_size, group_size)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scales = ((high - low) / 15).clamp(min=1e-12)
    levels = torch.round((groups - low[..., None]) / scales[..., None]).clamp(0, 15)
    zeros = low + 8 * scales
    scales_and_zeros = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous()
    return levels.to(torch.int32).view(out_features, in_features), scales_and_zeros


def dequantize_int4(levels: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """float32 [out, in] weights from `quantize_int4`'s levels and scales_and_zeros."""
    scales = scales_and_zeros[..., 0].float().t().repeat_interleave(group_size, dim=1)
    zeros = scales_and_zeros[..., 1].float().t().repeat_interleave(group_size, dim=1)
    return (levels.float() - 8) * scales + zeros


def int4_linear_reference(
    x: torch.Tensor,
    levels: torch.Tensor,
    scales_and_zeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    return F.linear(x, dequantize_int4(levels, scales_and_zeros, group_size).to(x.dtype), bias)


def int4_supported(in_features: int) -> bool:
    return in_features % INT4_GROUP_SIZE == 0


class Int4Linear(nn.Module):
    """Weight-only int4 projection (CPU); computes in bf16, the one activation dtype PyTorch's
    int4 CPU kernel is fast in (it is far slower with float32 activations)."""

    def __init__(
        self, levels: torch.Tensor, scales_and_zeros: torch.Tensor, bias: torch.Tensor | None
    ) -> None:
        super().__init__()
        self.out_features = levels.shape[0]
        self.register_buffer("packed_weight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(levels, 1))
        self.register_buffer("scales_and_zeros", scales_and_zeros.to(torch.bfloat16))
        self.bias = bias

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> Int4Linear:
        if weight.device.type != "cpu":
            raise ValueError(f"quantization: int4 runs on CPU only, not {weight.device.type}")
        return cls(*quantize_int4(weight), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A decode step calls this 120 times: skip the no-op reshapes and casts (a few
        # microseconds each) for the usual 2-D bf16 input.
        flat = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        if flat.dtype != torch.bfloat16:
            flat = flat.to(torch.bfloat16)
        output = torch.ops.aten._weight_int4pack_mm_for_cpu(
            flat, self.packed_weight, INT4_GROUP_SIZE, self.scales_and_zeros
        )
        if output.dtype != x.dtype:
            output = output.to(x.dtype)
        if self.bias is not None:
            output = output + self.bias
        return output if x.dim() == 2 else output.reshape(*x.shape[:-1], self.out_features)


def pack_int4(levels: torch.Tensor, scales_and_zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_int4`'s output in the native kernel's layout: levels uint8 [out, in / 2]
    (byte j of each group of 32 holds level j in its low nibble, level j + 16 in its high
    one) and bf16 scales_zeros [out, 2 * groups] (a row's group scales, then its zeros)."""
    out_features, in_features = levels.shape
    halves = levels.view(out_features, in_features // INT4_GROUP_SIZE, 2, INT4_GROUP_SIZE // 2).to(
        torch.uint8
    )
    packed = (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(out_features, in_features // 2)
    scales_zeros = torch.cat([scales_and_zeros[..., 0].t(), scales_and_zeros[..., 1].t()], dim=1)
    return packed.contiguous(), scales_zeros.to(torch.bfloat16).contiguous()


def unpack_int4(packed: torch.Tensor, scales_zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`pack_int4`'s inverse: (levels int32 [out, in], float32 scales_and_zeros [groups, out, 2])."""
    out_features = packed.shape[0]
    groups = packed.view(out_features, -1, INT4_GROUP_SIZE // 2)
    levels = torch.stack([groups & 0x0F, groups >> 4], dim=2).reshape(out_features, -1).to(torch.int32)
    scales, zeros = scales_zeros.float().chunk(2, dim=1)
    return levels, torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous()


class _PackedInt4Linear(nn.Module):
    """A weight-only int4 projection on a native kernel: owns the weights in `pack_int4`'s
    layout (levels, scales and zeros), the bias in the dtype its kernel adds, and the kernels."""

    def __init__(
        self,
        levels: torch.Tensor,
        scales_zeros: torch.Tensor,
        bias: torch.Tensor | None,
        kernels: native.NativeKernels,
    ) -> None:
        super().__init__()
        self.out_features = levels.shape[0]
        self.register_buffer("levels", levels)
        self.register_buffer("scales_zeros", scales_zeros)
        self.bias = self._kernel_bias(bias) if bias is not None else None
        self.kernels = kernels

    @staticmethod
    def _kernel_bias(bias: torch.Tensor) -> torch.Tensor:
        return bias

    @classmethod
    def from_float(
        cls, weight: torch.Tensor, bias: torch.Tensor | None, kernels: native.NativeKernels
    ) -> Self:
        return cls(*pack_int4(*quantize_int4(weight)), bias, kernels)


class NativeInt4Linear(_PackedInt4Linear):
    """Weight-only int4 projection on the native kernel (bf16 activations, float32 sums);
    the same weights and rounding as `Int4Linear`, in the layout the whole-step decode
    kernel (`firsttoken.ops.native_decode`) reads too. Steps of more rows than the kernel
    takes multiply by the dequantized weights."""

    @staticmethod
    def _kernel_bias(bias: torch.Tensor) -> torch.Tensor:
        # The AVX512-BF16 kernel and the whole-step decode add a contiguous bf16 bias.
        return bias.to(torch.bfloat16).contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        if flat.dtype != torch.bfloat16:
            flat = flat.to(torch.bfloat16)
        if flat.shape[0] <= native_abi.DECODE_MAX_ROWS:
            output = self.kernels.quantized.int4_matmul(
                self.levels, self.scales_zeros, self.bias, flat.contiguous()
            )
        else:
            output = int4_linear_reference(
                flat, *unpack_int4(self.levels, self.scales_zeros), INT4_GROUP_SIZE, self.bias
            )
        if output.dtype != x.dtype:
            output = output.to(x.dtype)
        return output if x.dim() == 2 else output.reshape(*x.shape[:-1], self.out_features)


class PortableInt4Linear(_PackedInt4Linear):
    """Weight-only int4 projection on the portable kernel (csrc/quantized_matmul.c, every ISA):
    float32 or bf16 activations, float32 sums, weights in `pack_int4`'s layout, the bias in the
    activations' dtype. A step of more rows than the kernel takes goes through it in pieces:
    each piece reads the weights again, but a row's bits never depend on the step."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = (x if x.dim() == 2 else x.reshape(-1, x.shape[-1])).contiguous()
        pieces = [
            self.kernels.quantized.portable_int4_matmul(self.levels, self.scales_zeros, self.bias, piece)
            for piece in flat.split(native_abi.DECODE_MAX_ROWS)
        ]
        output = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        return output if x.dim() == 2 else output.reshape(*x.shape[:-1], self.out_features)
