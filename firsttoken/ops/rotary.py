"""Rotary position embedding (the rotate-half layout of Hugging Face Llama), with its scalings."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RopeScaling:
    """A rope scaling rule: "linear" (positions divided by factor) or "llama3" (per-band)."""

    rope_type: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.rope_type not in ("linear", "llama3"):
            raise ValueError(
                f"rope_scaling: rope type {self.rope_type!r} is not supported (linear, llama3)"
            )
        if self.factor <= 0:
            raise ValueError(f"rope_scaling.factor: must be > 0, got {self.factor}")


def inverse_frequencies(
    head_dim: int, theta: float, scaling: RopeScaling | None, frequency_divisors: torch.Tensor | None
) -> torch.Tensor:
    """float32 [head_dim // 2] rotation speeds; `frequency_divisors` is GGUF's rope_freqs tensor."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if frequency_divisors is not None:
        return inv_freq / frequency_divisors.float()
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    return _llama3_inverse_frequencies(inv_freq, scaling)


def _llama3_inverse_frequencies(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between
    # interpolated smoothly.
    old_context = scaling.original_max_position_embeddings
    low_freq_wavelen = old_context / scaling.low_freq_factor
    high_freq_wavelen = old_context / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_context / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def cos_sin_table(inv_freq: torch.Tensor, max_positions: int) -> torch.Tensor:
    """float32 [max_positions, head_dim]: cos in the first half, sin in the second."""
    positions = torch.arange(max_positions, dtype=torch.float32)
    angles = positions[:, None] * inv_freq[None, :]  # [P, D/2]
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


def rotary_cos_sin(
    table: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [T, 1, head_dim] at `positions`, cast to the activations' dtype as
    transformers does; built once per step and shared by every layer."""
    cos_half, sin_half = table[positions].to(dtype).chunk(2, dim=-1)  # [T, D/2] each
    cos = torch.cat([cos_half, cos_half], dim=-1).unsqueeze(1)
    sin = torch.cat([sin_half, sin_half], dim=-1).unsqueeze(1)
    return cos, sin


def apply_rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] rotated: x * cos + rotate_half(x) * sin."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos + rotated * sin
