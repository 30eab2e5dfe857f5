"""Projections: the float Linear every layer starts as, and its weight-only int8 form.

Decoding on a CPU reads every weight once per step, so its speed is bound by the bytes of
the weights: int8 weights (per-output-channel scales, activations kept in float) halve what
bf16 reads. The int8 matmul is PyTorch's own CPU kernel; its plain reference dequantizes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """y = x W^T (+ b), W [out_features, in_features]."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


# Batch size oneDNN lays packed weights out for; measured to serve decode and prefill alike.
_PACKING_BATCH_HINT = 64


def onednn_packing_available(dtype: torch.dtype, device: torch.device) -> bool:
    """oneDNN packs bf16 weights on CPUs; other dtypes and devices keep plain matmuls."""
    return device.type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()


class PackedLinear(nn.Module):
    """A Linear whose weight oneDNN has reordered once into its blocked layout.

    A plain bf16 matmul reorders the weight on every call: in a decode step, where the
    weight is read once for one token, that reorder doubles the cost. The result is the
    same matmul, bit for bit.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features = weight.shape[0]
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight, _PACKING_BATCH_HINT))
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        leading = x.shape[:-1]
        output = torch.ops.mkldnn._linear_pointwise(
            x.reshape(-1, x.shape[-1]), self.packed_weight, self.bias, "none", [], ""
        )
        return output.reshape(*leading, self.out_features)


def pack_linears_onednn(module: nn.Module) -> None:
    """Replace every Linear below `module` with its PackedLinear (in place)."""
    _replace_linears(module, lambda linear: PackedLinear(linear.weight.data, _bias_of(linear)))


def _bias_of(linear: Linear) -> torch.Tensor | None:
    return linear.bias.data if linear.bias is not None else None


def _replace_linears(module: nn.Module, convert) -> None:
    for name, child in list(module.named_children()):
        if isinstance(child, Linear):
            setattr(module, name, convert(child))
        else:
            _replace_linears(child, convert)


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: (int8 [out, in], float32 scales [out]) with W ~ q * scale."""
    weight = weight.float()
    scales = weight.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    quantized = torch.round(weight / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return quantized, scales


def int8_linear_reference(
    x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    dequantized = (weight.float() * scales.float()[:, None]).to(x.dtype)
    return F.linear(x, dequantized, bias)


class Int8Linear(nn.Module):
    """Weight-only int8 projection; built from a loaded float Linear."""

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.register_buffer("weight", weight)
        self.register_buffer("scales", scales)
        self.bias = bias

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> Int8Linear:
        quantized, scales = quantize_int8(weight)
        return cls(quantized.to(weight.device), scales.to(device=weight.device, dtype=weight.dtype), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu":
            return int8_linear_reference(x, self.weight, self.scales, self.bias)
        leading = x.shape[:-1]
        output = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, x.shape[-1]), self.weight, self.scales)
        if self.bias is not None:
            output = output + self.bias
        return output.reshape(*leading, -1)


def quantize_linears_int8(module: nn.Module) -> None:
    """Replace every Linear below `module` with its Int8Linear (in place)."""
    _replace_linears(module, lambda linear: Int8Linear.from_float(linear.weight.data, _bias_of(linear)))
