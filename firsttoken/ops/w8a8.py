"""W8A8: int8 weights and int8 activations, multiplied in int32.

Prefill is bound by matmul throughput, and integer dot products do twice the multiply-adds of
bf16 ones per instruction (AMX-INT8 against AMX-BF16, AVX512-VNNI's `vpdpbusd` against
`vdpbf16ps`). The weights are quantized once, symmetric per output channel; each step's
activations per row (per token) at run time, symmetric, so a row's scale depends on that row
alone. oneDNN multiplies the unsigned activation bytes (the int8 levels + 128, zero point 128)
by the packed weight bytes, sums exactly in int32 and applies the weight scales; the row scales
and the bias follow in float. The projection itself, `W8A8Linear`, is in
`firsttoken.ops.w8a8_linear`.

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

from firsttoken.ops import native
from firsttoken.ops.cpu_info import cpu_flags
from firsttoken.ops.hadamard import walsh_hadamard_rows

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


@functools.cache
def onednn_int8_sums_exact() -> bool:
    """Whether oneDNN's uint8 x int8 matmul sums exactly here: the largest levels, whose pairs
    of products overflow a 16-bit lane (2 * 255 * 127 > 32767), against the int64 product."""
    activations = torch.full((4, 64), 255, dtype=torch.uint8)
    weight = torch.full((16, 64), INT8_LEVELS, dtype=torch.int8)
    weight[1::2] = -INT8_LEVELS
    try:
        packed = torch.ops.onednn.qlinear_prepack(weight, None)
        output = onednn_int8_matmul(activations, packed, torch.ones(16), no_zero_points(16), zero_point=0)
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


def no_zero_points(out_features: int) -> torch.Tensor:
    """The weights' zero points oneDNN asks for: symmetric weights have none."""
    return torch.zeros(out_features, dtype=torch.int64)


def onednn_int8_matmul(
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
