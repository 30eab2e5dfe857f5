"""W8A8 projections: int8 weights and int8 activations, multiplied in int32.

Prefill is bound by matmul throughput, and integer dot products do twice the multiply-adds of
bf16 ones per instruction (AMX-INT8 against AMX-BF16, AVX512-VNNI's `vpdpbusd` against
`vdpbf16ps`). The weights are quantized once, symmetric per output channel; each step's
activations per row (per token) at run time, symmetric, so a row's scale depends on that row
alone. oneDNN multiplies the unsigned activation bytes (the int8 levels + 128, zero point 128)
by the packed weight bytes, sums exactly in int32 and applies the weight scales; the row scales
and the bias follow in float.

The int32 sums make a row's result independent of the other rows in the step and of the
kernel's blocking. That needs exact sums: without VNNI, oneDNN's int8 kernels add pairs of
byte products in saturating 16-bit lanes (`vpmaddubsw`), which full-range activations
overflow. There the native kernel (csrc/w8a8_matmul.c, x86 builds with AVX2) multiplies int16
pairs into exact int32 sums instead, with the same scaling after them: the same bits as
oneDNN's path on a VNNI CPU, though slower than float32 on such CPUs (see docs/cpu.md). Without
either the quantization is refused (`w8a8_unsupported_reason`).

A few input channels of a layer's activations are far larger than the rest, and with one scale
per row they leave the other channels few levels. SmoothQuant's migration moves part of that
range into the weights, whose rows have a scale each: with s_j = max|x_j|^a / max|W_j|^(1-a)
from a calibration run's activation maxima, x_j / s_j and W_j * s_j give the same product, and
both quantize with less error. The division is folded into the quantization pass.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from firsttoken.ops import native, native_library
from firsttoken.ops.cpu_info import cpu_flags
from firsttoken.ops.hadamard import check_hadamard_block, walsh_hadamard_rows

# /proc/cpuinfo flags of the instructions oneDNN's exact int8 kernels use.
INT8_DOT_PRODUCT_FLAGS = ("amx_int8", "avx512_vnni", "avx_vnni")
ACTIVATION_ZERO_POINT = 128
INT8_LEVELS = 127
# SmoothQuant's migration strength: 0.5 splits the range evenly between activations and weights
# (on SmolLM2-135M, 0.5 and 0.65 gave the same perplexity; 0.8 was worse).
SMOOTHING_ALPHA = 0.5


@dataclass(frozen=True)
class Int8Weight:
    """A projection's weights as a W8A8 checkpoint stores them: int8 levels [out, in] and float32
    scales [out], W = levels * scale per output channel."""

    levels: torch.Tensor
    scales: torch.Tensor

    def rows(self, rows: torch.Tensor) -> Int8Weight:
        return Int8Weight(self.levels[rows].contiguous(), self.scales[rows].contiguous())

    def columns(self, start: int, end: int) -> Int8Weight:
        return Int8Weight(self.levels[:, start:end].contiguous(), self.scales)

    def dequantized(self) -> torch.Tensor:
        return self.levels.float() * self.scales[:, None]


def int8_weight_scales(weight: torch.Tensor) -> torch.Tensor:
    """Each output channel's symmetric int8 scale (float32 [out]): its largest magnitude / 127."""
    return weight.detach().float().abs().amax(dim=1).clamp(min=1e-12) / INT8_LEVELS


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8, the weights of W8A8 and of weight-only int8: (int8
    [out, in], float32 scales [out]) with W ~ q * scale."""
    weight = weight.float()
    scales = int8_weight_scales(weight)
    quantized = torch.round(weight / scales[:, None]).clamp(-INT8_LEVELS, INT8_LEVELS).to(torch.int8)
    return quantized, scales


def smoothing_factors(activation_max: torch.Tensor, weight: torch.Tensor, alpha: float) -> torch.Tensor:
    """SmoothQuant's per-input-channel factors s [in] for a weight [out, in] whose inputs reached
    `activation_max` [in] in calibration: the weight's columns are multiplied by s, the inputs
    divided by it."""
    weight_max = weight.float().abs().amax(dim=0).clamp(min=1e-5)
    return (activation_max.float().clamp(min=1e-5) ** alpha / weight_max ** (1 - alpha)).clamp(min=1e-5)


def quantize_rows(
    x: torch.Tensor, column_scales: torch.Tensor | None = None, hadamard_block: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of float `x` [rows, in] (times `column_scales` [in] where given, then turned by
    the Walsh-Hadamard transform in blocks of `hadamard_block` where above 1) in symmetric
    int8, stored shifted by the zero point as uint8 (the activation type oneDNN's fast int8
    kernels take): (uint8 [rows, in], float32 scales [rows]) with x ~ (q - 128) * scale, the
    levels round(x * (127 / absmax)). A zero row gets scale 1 and all levels 128."""
    x = x.float()
    if column_scales is not None:
        x = x * column_scales
    if hadamard_block > 1:
        x = walsh_hadamard_rows(x, hadamard_block)
    row_max = x.abs().amax(dim=1)
    nonzero = row_max > 0
    scales = torch.where(nonzero, row_max / INT8_LEVELS, torch.ones_like(row_max))
    # Times the inverse, as vLLM's kernels take it: a division per element costs the native
    # pass a quarter of its time. (127 / tensor would be 127 * (1 / tensor), another rounding.)
    inverse_scales = torch.where(
        nonzero, torch.full_like(row_max, INT8_LEVELS) / row_max, torch.ones_like(row_max)
    )
    levels = torch.round(x * inverse_scales[:, None]).clamp_(-INT8_LEVELS, INT8_LEVELS)
    return levels.add_(ACTIVATION_ZERO_POINT).to(torch.uint8), scales


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


@functools.cache
def onednn_int8_sums_exact() -> bool:
    """Whether oneDNN's uint8 x int8 matmul sums exactly here: the largest levels, whose pairs
    of products overflow a 16-bit lane (2 * 255 * 127 > 32767), against the int64 product."""
    activations = torch.full((4, 64), 255, dtype=torch.uint8)
    weight = torch.full((16, 64), INT8_LEVELS, dtype=torch.int8)
    weight[1::2] = -INT8_LEVELS
    try:
        packed = torch.ops.onednn.qlinear_prepack(weight, None)
        output = _onednn_int8_matmul(activations, packed, torch.ones(16), _no_zero_points(16), zero_point=0)
    except RuntimeError:  # no oneDNN int8 kernels for this CPU at all
        return False
    expected = (activations.to(torch.int64) @ weight.to(torch.int64).t()).float()
    return torch.equal(output, expected)


def w8a8_on_native_matmul(kernels: native.NativeKernels | None) -> bool:
    """Whether W8A8 projections run on the native kernels' int8 matmul: where they have one and
    oneDNN's sums are not exact (AVX2 without VNNI saturates them), where it runs on AMX-INT8
    tiles, or where it runs on VNNI and oneDNN has no AMX tiles. It scales and rounds the sums
    while they are in registers or L1, where oneDNN writes float32 rows that another pass reads
    back (`benchmarks/w8a8_matmul.py`, SmolLM2's projections at 512 and 2048 rows: on 2 Zen 4
    cores 0.85-0.92x the time of oneDNN's product and that pass; on 2 Sapphire Rapids-class
    cores, on its AMX tiles, 0.60-0.69x)."""
    if kernels is None or not kernels.w8a8.has_w8a8_matmul:
        return False
    return (
        not onednn_int8_sums_exact()
        or kernels.w8a8.w8a8_matmul_uses_amx
        or (kernels.w8a8.w8a8_matmul_uses_vnni and "amx_int8" not in cpu_flags())
    )


def w8a8_unsupported_reason(
    device: torch.device, kernels: native.NativeKernels | None = None
) -> str | None:
    """Why W8A8 cannot run here (None where it can): it needs exact int8 sums, from oneDNN on a
    CPU with VNNI or AMX-INT8, or from `kernels` where they hold the native int8 matmul."""
    if device.type != "cpu":
        return f"w8a8 runs on CPU only, not {device.type}"
    if kernels is not None and kernels.w8a8.has_w8a8_matmul:
        return None
    if not torch.backends.mkldnn.is_available():
        return "w8a8 needs PyTorch built with oneDNN"
    if not onednn_int8_sums_exact():
        have = ", ".join(flag for flag in INT8_DOT_PRODUCT_FLAGS if flag in cpu_flags()) or "none of them"
        return (
            f"w8a8 needs exact int8 sums from oneDNN, which take one of {', '.join(INT8_DOT_PRODUCT_FLAGS)} "
            f"(this CPU has {have}; ONEDNN_MAX_CPU_ISA may also hold oneDNN below them): without them "
            "its int8 kernels saturate; the native kernels' exact int8 matmul needs an x86 CPU with AVX2"
        )
    return None


def _no_zero_points(out_features: int) -> torch.Tensor:
    """The weights' zero points oneDNN asks for: symmetric weights have none."""
    return torch.zeros(out_features, dtype=torch.int64)


def _onednn_int8_matmul(
    levels: torch.Tensor,
    packed_weight: torch.Tensor,
    weight_scales: torch.Tensor,
    weight_zero_points: torch.Tensor,
    zero_point: int,
) -> torch.Tensor:
    """float32 [rows, out]: sum over k of (levels - zero_point) * weight, times the weight's scale."""
    return torch.ops.onednn.qlinear_pointwise(
        levels, 1.0, zero_point, packed_weight, weight_scales, weight_zero_points, None,
        1.0, 0, torch.float32, "none", [], "",
    )


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
        self.register_buffer("weight_zero_points", _no_zero_points(weight.shape[0]))
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
        sums = _onednn_int8_matmul(
            levels, self.packed_weight, self.weight_scales, self.weight_zero_points, ACTIVATION_ZERO_POINT
        )
        if self.kernels is not None:
            return self.kernels.rows.rescale_rows(sums, row_scales, self.bias, dtype)
        return rescale_rows(sums, row_scales, self.bias, dtype)
