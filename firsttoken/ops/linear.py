"""Float projections: the Linear every layer starts as, and the forms that serve it faster:
oneDNN-packed (`PackedLinear`), widened to float32 on a CPU without bf16 matmul kernels
(`WidenedLinear`), on the native row-invariant matmul (`NativeRowInvariantLinear`), and an LM head
whose logits are summed and kept in float32 (`Float32LogitsHead`). Its weight-only int8 and int4
forms are in `firsttoken.ops.quantized_linear`; which form serves each projection,
`firsttoken.ops.linear_choice`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from firsttoken.ops import native, native_abi
from firsttoken.ops.w8a8 import Int8Weight
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
    return NativeRowInvariantLinear(linear.weight.data, bias_of(linear), native_kernels)


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


def bias_of(linear: Linear) -> torch.Tensor | None:
    return linear.bias.data if linear.bias is not None else None


def replace_linears(module: nn.Module, convert) -> None:
    """Replace every Linear below `module` (in place) with `convert(linear)`."""
    for name, child in list(module.named_children()):
        if isinstance(child, Linear):
            setattr(module, name, convert(child))
        else:
            replace_linears(child, convert)




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
