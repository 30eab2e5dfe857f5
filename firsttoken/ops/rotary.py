"""Rotary position embedding (the rotate-half layout of Hugging Face Llama), with its scalings.

Partial rotary (Phi-3's `partial_rotary_factor`: only the first rotary_dim dims of a head
rotate) runs on the same full-head kernels: `partial_rotary_order` reorders each query and key
head's dims at load so the rotated pairs sit half a head apart and the others pair up under
angle 0 (cos 1, sin 0, which leave them exactly as they are); scores q.k are unchanged by the
same reordering of both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


ROPE_TYPES = ("linear", "llama3", "longrope")


@dataclass(frozen=True)
class RopeScaling:
    """A rope scaling rule: "linear" (positions divided by factor), "llama3" (per-band) or
    "longrope" (Phi-3: each frequency divided by its short_factor or long_factor entry, see
    `uses_long_factor`; cos and sin times attention_factor)."""

    rope_type: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(
                f"rope_scaling: rope type {self.rope_type!r} is not supported ({', '.join(ROPE_TYPES)})"
            )
        if self.factor <= 0:
            raise ValueError(f"rope_scaling.factor: must be > 0, got {self.factor}")
        # Lists from JSON (the conversion cache's metadata) made hashable like the rest.
        object.__setattr__(self, "short_factor", tuple(float(value) for value in self.short_factor))
        object.__setattr__(self, "long_factor", tuple(float(value) for value in self.long_factor))
        if self.rope_type == "longrope" and not (self.short_factor and self.long_factor):
            raise ValueError("rope_scaling: longrope needs both short_factor and long_factor")

    def uses_long_factor(self, max_positions: int) -> bool:
        """Whether LongRoPE takes long_factor for an engine serving sequences up to
        `max_positions` tokens: exactly when they may pass original_max_position_embeddings.

        transformers decides per forward (long when that forward's last position + 1 exceeds
        original_max_position_embeddings), so one sequence's keys can be rotated by both sets.
        One choice per engine keeps a token's rotation independent of its batch, its prefill
        chunks and the prefix cache, and gives transformers' numbers wherever every forward of
        a sequence makes its choice: all sequences within original_max_position_embeddings when
        max_positions is, and prompts longer than it otherwise (as llama.cpp decides by its
        context size)."""
        return max_positions > self.original_max_position_embeddings


def inverse_frequencies(
    rotary_dim: int,
    theta: float,
    scaling: RopeScaling | None,
    frequency_divisors: torch.Tensor | None,
    max_positions: int | None = None,
) -> torch.Tensor:
    """float32 [rotary_dim // 2] rotation speeds; `frequency_divisors` is GGUF's rope_freqs tensor;
    `max_positions` (the longest sequence served) picks LongRoPE's factors."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    if frequency_divisors is None and scaling is not None and scaling.rope_type == "longrope":
        # transformers' order of operations: one rounding where dividing twice would take two.
        return 1.0 / (_longrope_factors(scaling, rotary_dim, max_positions) * theta**exponents)
    inv_freq = 1.0 / (theta**exponents)
    if frequency_divisors is not None:
        return inv_freq / frequency_divisors.float()
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    return _llama3_inverse_frequencies(inv_freq, scaling)


def _longrope_factors(scaling: RopeScaling, rotary_dim: int, max_positions: int | None) -> torch.Tensor:
    if max_positions is None:
        raise ValueError("rope_scaling: longrope needs the longest sequence served to pick its factors")
    use_long = scaling.uses_long_factor(max_positions)
    name = "long_factor" if use_long else "short_factor"
    factors = scaling.long_factor if use_long else scaling.short_factor
    if len(factors) != rotary_dim // 2:
        raise ValueError(
            f"rope_scaling.{name}: has {len(factors)} entries, expected {rotary_dim // 2} (rotary dims / 2)"
        )
    return torch.tensor(factors, dtype=torch.float32)


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


def cos_sin_table(
    inv_freq: torch.Tensor, max_positions: int, head_dim: int | None = None, attention_factor: float = 1.0
) -> torch.Tensor:
    """float32 [max_positions, head_dim]: cos in the first half, sin in the second, both times
    `attention_factor` (LongRoPE's) as transformers scales them. A head wider than the rotated
    dims (partial rotary, in `partial_rotary_order`'s layout) gets cos 1 and sin 0 for the rest."""
    positions = torch.arange(max_positions, dtype=torch.float32)
    angles = positions[:, None] * inv_freq[None, :]  # [P, rotary_dim / 2]
    cos, sin = angles.cos() * attention_factor, angles.sin() * attention_factor
    unrotated = (head_dim or 2 * inv_freq.numel()) // 2 - inv_freq.numel()
    if unrotated:
        cos = torch.cat([cos, torch.ones(max_positions, unrotated)], dim=-1)
        sin = torch.cat([sin, torch.zeros(max_positions, unrotated)], dim=-1)
    return torch.cat([cos, sin], dim=-1)


def partial_rotary_order(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """int64 [head_dim]: the original dim each dim of a reordered query or key head holds.
    Rotary pairs dims (i, i + rotary_dim / 2) of the first rotary_dim; the full-head kernels
    pair (i, i + head_dim / 2). So the first half holds the rotated pairs' first members, then
    half the unrotated dims; the second half their partners, then the other unrotated half."""
    rotated_half, unrotated_half = rotary_dim // 2, (head_dim - rotary_dim) // 2
    return torch.cat([
        torch.arange(0, rotated_half),
        torch.arange(rotary_dim, rotary_dim + unrotated_half),
        torch.arange(rotated_half, rotary_dim),
        torch.arange(rotary_dim + unrotated_half, head_dim),
    ])


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
