"""Which form serves each projection: float weights (`firsttoken.ops.linear`), weight-only
quantized ones (`firsttoken.ops.quantized_linear`), or both.

The quantized kernels lose to the float (oneDNN, AMX) matmul once a step has more than a few
rows, so by default a quantized projection keeps its float weights too and serves prefill-sized
steps from them (`DecodeQuantizedLinear`).
"""

from __future__ import annotations

import torch
from torch import nn

from firsttoken.ops import native, native_abi
from firsttoken.ops.linear import (
    Float32LogitsHead,
    Linear,
    PackedLinear,
    WidenedLinear,
    bias_of,
    replace_linears,
    row_invariant_linear,
    takes_float32_logits,
    widens_to_float32,
)
from firsttoken.ops.quantized_linear import (
    Int4Linear,
    Int8Linear,
    NativeInt4Linear,
    PortableInt4Linear,
    int4_supported,
)


# Most rows a step may have for its projections to take the quantized kernels. Past these,
# PyTorch's int8/int4 CPU kernels cost more than the float (oneDNN) matmul: measured over
# SmolLM2-135M's 120 projections, bf16 weights streamed from memory, 2 cores:
# rows         1     4     8    16
# bf16      20.8  21.0  21.5  21.5 ms
# int8      13.7  18.3  27.9  47.2 ms
# int4       7.2  10.5  18.6  34.9 ms
QUANTIZED_MAX_ROWS = {"int8": 4, "int4": 8}
# The portable kernels take float32 steps of up to the most rows they take: there torch's
# int4/int8 kernels with float32 activations are slower still, and at 4 and 8 rows both
# portable kernels beat float32 F.linear. Measured over SmolLM2-135M's 120 projections (weights
# streamed from memory; AVX2 build; 2 cores shared with other work, so only ratios count;
# benchmarks/quantized_decode.py), ms ratios to float32 F.linear, 2 threads:
# rows                     1      4      8
# portable int4          6.6   0.70   0.73
# portable int8          5.3   0.66   0.59
# torch int4, float32   13.5   2.66   4.79
# torch int8, float32    7.6   1.02   1.48
# At one row F.linear stayed on one thread while the OpenMP kernels waited for the busy
# second core; on one thread (gate/up shape, 40 weights) portable int4 is 0.74 of F.linear at
# 1 row and 0.59 at 8.
PORTABLE_QUANTIZED_MAX_ROWS = native_abi.DECODE_MAX_ROWS


class DecodeQuantizedLinear(nn.Module):
    """Quantized weights for decode-sized steps (bound by reading the weights), float weights
    for prefill-sized ones (bound by compute, where the float matmul is the faster kernel)."""

    def __init__(self, quantized: nn.Module, full_precision: nn.Module, max_quantized_rows: int) -> None:
        super().__init__()
        self.quantized = quantized
        self.full_precision = full_precision
        self.max_quantized_rows = max_quantized_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0] if x.dim() == 2 else x.numel() // x.shape[-1]
        if rows <= self.max_quantized_rows:
            return self.quantized(x)
        return self.full_precision(x)


def _native_int4_takes(weight: torch.Tensor, native_kernels: native.NativeKernels | None) -> bool:
    return (
        native_kernels is not None and native_kernels.has_decode_kernels and weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16 and weight.shape[1] % native_abi.INT4_INPUT_MULTIPLE == 0
    )


def _portable_int4_takes(weight: torch.Tensor, native_kernels: native.NativeKernels | None) -> bool:
    """float32 projections take the portable int4 kernel wherever native kernels are built:
    torch's int4 kernel with float32 activations is the slowest choice of all (see
    `PORTABLE_QUANTIZED_MAX_ROWS`). bf16 ones without AVX512-BF16 keep torch's int4 kernel,
    which computes in bf16 and is faster there than ours widening to float32."""
    return (
        native_kernels is not None and weight.device.type == "cpu" and weight.dtype == torch.float32
        and weight.shape[1] % native_abi.PORTABLE_INT4_INPUT_MULTIPLE == 0
    )


def max_quantized_rows(quantized: nn.Module, quantization: str) -> int:
    """Most rows a step may have to take `quantized` rather than the float weights."""
    if isinstance(quantized, PortableInt4Linear) or (
        isinstance(quantized, Int8Linear) and quantized.runs_portable
    ):
        return PORTABLE_QUANTIZED_MAX_ROWS
    return QUANTIZED_MAX_ROWS[quantization]


def quantized_linear(
    linear: nn.Module, quantization: str, native_kernels: native.NativeKernels | None = None
) -> nn.Module:
    """`linear` (a Linear) in weight-only `quantization`; int4 needs whole groups along its
    input, and a projection without them takes int8. int4 takes a native kernel where
    there is one for its dtype."""
    weight, bias = linear.weight.data, bias_of(linear)
    if quantization == "int4" and int4_supported(weight.shape[1]):
        if _native_int4_takes(weight, native_kernels):
            return NativeInt4Linear.from_float(weight, bias, native_kernels)
        if _portable_int4_takes(weight, native_kernels):
            return PortableInt4Linear.from_float(weight, bias, native_kernels)
        return Int4Linear.from_float(weight, bias)
    return Int8Linear.from_float(weight, bias, native_kernels)


def convert_linears(
    module: nn.Module,
    quantization: str | None,
    quantized_prefill: bool,
    pack_onednn: bool,
    native_kernels: native.NativeKernels | None = None,
    row_invariant_float: bool = False,
) -> None:
    """Replace every Linear below `module` (in place) with the form that serves it fastest:
    oneDNN-packed where available, and with quantized weights for decode when asked."""
    replace_linears(
        module,
        lambda linear: fastest_linear(
            linear, quantization, quantized_prefill, pack_onednn, native_kernels, row_invariant_float
        ),
    )


def fastest_linear(
    linear: Linear,
    quantization: str | None,
    quantized_prefill: bool,
    pack_onednn: bool,
    native_kernels: native.NativeKernels | None = None,
    row_invariant_float: bool = False,
) -> nn.Module:
    """`row_invariant_float`: the float weights (of a quantized projection's larger steps too)
    on the native row-invariant matmul, as an unquantized engine with batch invariance runs
    them; else oneDNN-packed or torch's."""
    if quantization is not None and quantized_prefill:
        return quantized_linear(linear, quantization, native_kernels)
    if row_invariant_float and native_kernels is not None:
        full_precision = row_invariant_linear(linear, native_kernels)
    else:
        full_precision = _float_linear(linear, pack_onednn)
    if quantization is None:
        return full_precision
    quantized = quantized_linear(linear, quantization, native_kernels)
    return DecodeQuantizedLinear(quantized, full_precision, max_quantized_rows(quantized, quantization))


def head_linear(
    linear: Linear, pack_onednn: bool, native_kernels: native.NativeKernels | None, row_invariant_float: bool
) -> nn.Module:
    """An unquantized LM head: float32 logits where `takes_float32_logits`, else the float
    projection `fastest_linear` makes."""
    if takes_float32_logits(linear, native_kernels):
        return Float32LogitsHead(linear.weight.data, native_kernels)
    return fastest_linear(linear, None, False, pack_onednn, native_kernels, row_invariant_float)


def _float_linear(linear: Linear, pack_onednn: bool) -> nn.Module:
    if pack_onednn:
        return PackedLinear(linear.weight.data, bias_of(linear))
    if widens_to_float32(linear.weight):
        return WidenedLinear(linear.weight.data, bias_of(linear))
    return linear
