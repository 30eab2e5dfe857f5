"""Projections: the float Linear every layer starts as, and its weight-only int8 and int4 forms.

Decoding on a CPU reads every weight once per step, so its speed is bound by the bytes of the
weights: int8 weights (per-output-channel scales) halve what bf16 reads, int4 (groups of 32
with a scale and a zero each) quarter it. The quantized matmuls are PyTorch's own CPU kernels,
on CPUs with AVX512-BF16 our own for bf16 (`NativeInt4Linear`, and `Int8Linear` for decode-
sized steps), and for float32 activations on any CPU our portable ones (`PortableInt4Linear`,
`Int8Linear`); each plain reference dequantizes. Those kernels lose to the float (oneDNN, AMX)
matmul once a step has more than a few rows, so by default a quantized projection keeps its
float weights too and serves prefill-sized steps from them (`DecodeQuantizedLinear`).
"""

from __future__ import annotations

from typing import Self

import torch
import torch.nn.functional as F
from torch import nn

from firsttoken.ops import native, native_abi
from firsttoken.ops.native_abi import INT4_GROUP_SIZE
from firsttoken.ops.w8a8 import Int8Weight, quantize_int8
from firsttoken.ops.weight_levels import pack_levels


class Linear(nn.Module):
    """y = x W^T (+ b), W [out_features, in_features]. `checkpoint_int8`: the levels and scales a
    W8A8 checkpoint stores for it (its float weight is their dequantized form), which W8A8 takes
    as they are."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None
        )
        self.checkpoint_int8: Int8Weight | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


# Batch size oneDNN lays packed weights out for; measured to serve decode and prefill alike.
_PACKING_BATCH_HINT = 64


def cpu_computes_bf16() -> bool:
    """Whether oneDNN has bf16 matmul kernels for this CPU (AVX512-BF16, AMX, AVX-512 BW/VL/DQ or
    AVX-NE-CONVERT); elsewhere (AVX2) it has none, and a bf16 matmul takes a slow fallback."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def onednn_packing_available(dtype: torch.dtype, device: torch.device) -> bool:
    """oneDNN packs bf16 weights on CPUs it has bf16 kernels for; other dtypes, CPUs and devices
    keep plain matmuls."""
    return device.type == "cpu" and dtype == torch.bfloat16 and cpu_computes_bf16()


class PackedLinear(nn.Module):
    """A Linear whose weight oneDNN has reordered once into its blocked layout.

    A plain bf16 matmul reorders the weight on every call: in a decode step, where the
    weight is read once for one token, that reorder doubles the cost. The result is the
    same matmul, bit for bit.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features = weight.shape[0]
        self.register_buffer(
            "packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight, _PACKING_BATCH_HINT)
        )
        self.bias = bias
        # oneDNN runs a one-row input on another kernel, which sums some rows' products in
        # another order (576 x 1536 bf16: a row differs in ~1 of 20 random weights); from two
        # rows on, a row's result is the same bits whatever the row count (measured up to 700).
        # Run one row as two, and a row never depends on what else is in the step.
        self.pad_single_rows = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        leading = x.shape[:-1]
        flat = x.reshape(-1, x.shape[-1])
        rows = flat.shape[0]
        if rows == 1 and self.pad_single_rows:
            flat = flat.expand(2, -1).contiguous()
        output = torch.ops.mkldnn._linear_pointwise(flat, self.packed_weight, self.bias, "none", [], "")
        return output[:rows].reshape(*leading, self.out_features)


class WidenedLinear(nn.Module):
    """A bf16 projection on a CPU without bf16 matmul kernels: the weight widened to float32 once
    (exact), each step's input widened, the product summed in float32 and rounded to bf16, as a
    bf16 matmul with float32 accumulation does (vLLM-CPU's way on such CPUs), where torch's own
    bf16 matmul is several times slower than its float32 one."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features = weight.shape[0]
        self.register_buffer("weight", weight.float())
        self.bias = bias.float() if bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight, self.bias).to(x.dtype)


def widens_to_float32(weight: torch.Tensor) -> bool:
    """Whether a projection of this weight computes in float32: bf16 on a CPU oneDNN has no bf16
    kernels for."""
    return weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and not cpu_computes_bf16()
def native_row_invariant_available(dtype: torch.dtype, native_kernels: native.NativeKernels | None) -> bool:
    """Whether float projections can take `NativeRowInvariantLinear`: float32 with native kernels."""
    return native_kernels is not None and dtype == torch.float32


class NativeRowInvariantLinear(nn.Module):
    """A float32 projection on the native row-invariant matmul: every output is one FMA chain
    over the inputs in order, so a row's bits never depend on the other rows in the step or on
    the thread count (torch's float32 matmul picks its kernel and blocking by the row count).
    The weight is packed once into the kernel's column panels, in float32 or, to halve the
    bytes a decode step reads, bf16 widened in registers; a float32 weight dequantized from GGUF
    blocks is also kept as its levels, which decode-sized steps read instead (a fifth of the
    bytes for 4-bit levels, the same bits)."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        kernels: native.NativeKernels,
        weight_dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.out_features = weight.shape[0]
        self.register_buffer("packed_weight", kernels.matmul.pack_matmul_weight(weight.float(), weight_dtype))
        self.bias = bias.float().contiguous() if bias is not None else None
        self.kernels = kernels
        # A weight dequantized from GGUF blocks, also as its levels: decode-sized steps read
        # those, with the same bits (ops/weight_levels.py).
        found = kernels.matmul.find_levels(weight) if weight_dtype == torch.float32 else None
        self.levels = pack_levels(found, kernels.matmul.matmul_panel_width) if found is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        if flat.stride(-1) != 1:
            flat = flat.contiguous()
        if self.levels is not None and flat.shape[0] <= native_abi.LEVELS_MAX_ROWS:
            output = self.kernels.matmul.row_invariant_levels_matmul(
                flat, self.levels, self.bias, self.out_features
            )
        else:
            output = self.kernels.matmul.row_invariant_matmul(
                flat, self.packed_weight, self.bias, self.out_features
            )
        return output if x.dim() == 2 else output.reshape(*x.shape[:-1], self.out_features)


def row_invariant_linear(linear: Linear, native_kernels: native.NativeKernels) -> NativeRowInvariantLinear:
    return NativeRowInvariantLinear(linear.weight.data, _bias_of(linear), native_kernels)


# Row counts `rows_invariant` compares: one-row and batched decodes, chunks, a long prefill.
# oneDNN's AMX kernels pick their blocking by the row count in ranges (33, 65, 100, 513, ...),
# and a row may change bits anywhere in the step, not only in the first rows.
_INVARIANCE_PROBE_ROWS = (1, 2, 3, 8, 17, 33, 64, 100, 300, 1024)


def rows_invariant(linear: PackedLinear, seed: int = 0) -> bool:
    """Whether `linear` gives every row the bits it gets in the longest probed step, at every
    probed row count, as oneDNN's AVX512-BF16 kernels do; a CPU whose oneDNN switches kernels
    with the row count (AMX: to other tiles and blockings for larger steps) fails. Random
    inputs: a probe, not a proof."""
    generator = torch.Generator().manual_seed(seed)
    in_features = linear.packed_weight.shape[1]
    x = torch.randn(max(_INVARIANCE_PROBE_ROWS), in_features, generator=generator).to(
        linear.packed_weight.dtype
    )
    longest = linear(x)
    return all(torch.equal(linear(x[:rows]), longest[:rows]) for rows in _INVARIANCE_PROBE_ROWS[:-1])


def _bias_of(linear: Linear) -> torch.Tensor | None:
    return linear.bias.data if linear.bias is not None else None


def replace_linears(module: nn.Module, convert) -> None:
    """Replace every Linear below `module` (in place) with `convert(linear)`."""
    for name, child in list(module.named_children()):
        if isinstance(child, Linear):
            setattr(module, name, convert(child))
        else:
            replace_linears(child, convert)


def int8_linear_reference(
    x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    dequantized = (weight.float() * scales.float()[:, None]).to(x.dtype)
    return F.linear(x, dequantized, bias)


class Int8Linear(nn.Module):
    """Weight-only int8 projection; built from a loaded float Linear. With native kernels,
    steps of up to `native_abi.DECODE_MAX_ROWS` rows take ours: bf16 ones the AVX512-BF16 int8
    kernel (the same weights, scales and bf16 roundings as torch's), float32 ones the portable
    kernel (see `PORTABLE_QUANTIZED_MAX_ROWS`)."""

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
    weight, bias = linear.weight.data, _bias_of(linear)
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


class Float32LogitsHead(nn.Module):
    """A bf16 LM head whose logits are summed and kept in float32 (`MatmulKernels.float32_logits`),
    where a bf16 matmul rounds each to bf16: logits near 15 move in steps of 0.06 there, and which
    of two close candidates a greedy step takes is that rounding's pick. On SmolLM2-135M, teacher-
    forced over GPL-3's text, bf16's top-1 tokens agree with float32's at 0.969 of the positions
    with bf16 logits and 0.979 with these; a row's logits never depend on the other rows."""

    def __init__(self, weight: torch.Tensor, native_kernels: native.NativeKernels) -> None:
        super().__init__()
        self.out_features = weight.shape[0]
        self.native_kernels = native_kernels
        self.register_buffer("packed_weight", native_kernels.matmul.pack_logits_weight(weight))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        leading = x.shape[:-1]
        flat = x.reshape(-1, x.shape[-1])
        logits = self.native_kernels.matmul.float32_logits(flat, self.packed_weight, self.out_features)
        return logits.reshape(*leading, self.out_features)


def takes_float32_logits(linear: Linear, native_kernels: native.NativeKernels | None) -> bool:
    """Whether an unquantized LM head runs as `Float32LogitsHead`: bf16 weights without bias on
    the CPU, native kernels with AVX512-BF16, a hidden size divisible by 4."""
    weight = linear.weight
    return (
        native_kernels is not None and native_kernels.matmul.has_float32_logits
        and weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and linear.bias is None
        and weight.shape[1] % 4 == 0
    )


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
        return PackedLinear(linear.weight.data, _bias_of(linear))
    if widens_to_float32(linear.weight):
        return WidenedLinear(linear.weight.data, _bias_of(linear))
    return linear
