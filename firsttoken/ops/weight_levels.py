"""A float32 weight's exact form as GGUF-style block levels, found from its values.

A weight dequantized from Q4_0, Q4_1, Q4_K or Q8_0 holds, per output and group of 32 inputs, at
most 16 (or 256) values on a grid: w = level * scale (+ offset), with scale and offset fp16 values
(Q4_K: fp16 values times 6-bit integers) and the float32 multiply-then-add of the dequantization
(exact: level * scale has at most 17 + 8 significant bits). `MatmulKernels.find_levels`
(csrc/weight_levels.c) recovers levels, scales and offsets from the float32 values alone,
whatever fused, permuted or cached them on the way, and keeps them only where every weight
rebuilds to its own bits; so a projection on the levels computes with exactly the weights of its
float32 form while a decode step reads a fifth of the bytes (4-bit levels).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from firsttoken.arithmetic import ceil_div
from firsttoken.ops.native_abi import LEVELS_GROUP


@dataclass(frozen=True)
class WeightLevels:
    """W [out, in] = levels * scales (+ offsets) per group of LEVELS_GROUP inputs, exactly."""

    bits: int  # 4: levels 0..15 with offsets; 8: signed levels, no offsets
    levels: torch.Tensor  # uint8 (4 bits) or int8 (8 bits) [out, in]
    scales: torch.Tensor  # float32 [out, in / LEVELS_GROUP]
    offsets: torch.Tensor | None  # float32 [out, in / LEVELS_GROUP] for 4-bit levels

    def dequantized(self) -> torch.Tensor:
        """The float32 weight the levels stand for."""
        out_features, in_features = self.levels.shape
        groups = self.levels.float().view(out_features, -1, LEVELS_GROUP) * self.scales.unsqueeze(-1)
        if self.offsets is not None:
            groups = groups + self.offsets.unsqueeze(-1)
        return groups.view(out_features, in_features)


@dataclass(frozen=True)
class PackedLevels:
    """`WeightLevels` in the levels matmul's panels of `panel_width` output columns
    (csrc/matmul.c): levels [panels, in, panel_width * bits / 8] (4 bits: column c in the low
    nibble of byte c, column c + panel_width / 2 in its high one), scales and offsets [panels,
    in / LEVELS_GROUP, panel_width]; padding columns are zeros."""

    bits: int
    levels: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None


def pack_levels(levels: WeightLevels, panel_width: int) -> PackedLevels:
    """`levels` in the panel layout of the kernels' `panel_width`."""
    out_features, in_features = levels.levels.shape
    panels = ceil_div(out_features, panel_width)
    padding = panels * panel_width - out_features

    def by_panel(values: torch.Tensor) -> torch.Tensor:
        padded = torch.nn.functional.pad(values, (0, 0, 0, padding))
        return padded.view(panels, panel_width, -1).transpose(1, 2).contiguous()

    level_panels = by_panel(levels.levels.view(torch.uint8))
    if levels.bits == 4:
        half = panel_width // 2
        level_panels = level_panels[..., :half] | (level_panels[..., half:] << 4)
    offsets = by_panel(levels.offsets) if levels.offsets is not None else None
    return PackedLevels(levels.bits, level_panels.contiguous(), by_panel(levels.scales), offsets)
