"""The gated activations on the fused gate-up projection: SwiGLU (Llama) and GeGLU (Gemma)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
