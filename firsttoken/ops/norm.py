"""RMSNorm, alone and fused with the residual add that precedes it in every Llama block."""

from __future__ import annotations

import torch


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The definition (as in transformers): normalize in float32, scale in the input dtype."""
    x_fp32 = x.float()
    variance = x_fp32.pow(2).mean(-1, keepdim=True)
    normed = (x_fp32 * torch.rsqrt(variance + eps)).to(x.dtype)
    return weight * normed


def add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual): the block's normed input and new residual."""
    summed = x + residual
    return rms_norm_reference(summed, weight, eps), summed
