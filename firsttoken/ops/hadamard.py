"""The Walsh-Hadamard transform of a projection's inputs, in blocks: the run-time part of a
rotated model's W8A8 (`firsttoken.models.rotation`), where down_proj's inputs turn by an
orthogonal matrix H whose inverse is folded into its weights.

The transform runs as butterflies (a + b, a - b over pairs 1, 2, 4, ... apart, then times
1 / sqrt(block)): log2(block) additions per input, each row on its own, so a row's values never
depend on the other rows of a step. The native kernels do the same additions in the same order
inside the W8A8 quantization pass (`ft_quantize_rows_int8`), and so give the same bits.
"""

from __future__ import annotations

import math

import torch
from torch import nn

# The widest block: wider spreads an outlier over more inputs, and costs one more addition per
# input for each doubling.
MAX_HADAMARD_BLOCK = 512


def hadamard_block(features: int) -> int:
    """The largest power of two dividing `features`, at most MAX_HADAMARD_BLOCK."""
    block = 1
    while features % (2 * block) == 0 and 2 * block <= MAX_HADAMARD_BLOCK:
        block *= 2
    return block


def check_hadamard_block(features: int, block: int) -> None:
    """A transform of `features` inputs in blocks of `block`: a power of two dividing them (the
    native pass turns whole blocks in place; any other block would run past a row)."""
    if block < 1 or block & (block - 1) or features % block:
        raise ValueError(f"a Hadamard block of {block} does not tile {features} inputs in powers of two")


def walsh_hadamard(order: int) -> torch.Tensor:
    """The orthonormal Sylvester-Hadamard matrix of `order` (a power of two), symmetric. float64."""
    matrix = torch.ones(1, 1, dtype=torch.float64)
    while matrix.shape[0] < order:
        matrix = torch.cat([torch.cat([matrix, matrix], 1), torch.cat([matrix, -matrix], 1)])
    return matrix / math.sqrt(order)


def hadamard_norm(block: int) -> float:
    """1 / sqrt(block) in float64; both the torch transform and the native pass (a C float
    argument) round it once to float32, so they scale by the same value."""
    return 1.0 / math.sqrt(block)


def walsh_hadamard_rows(x: torch.Tensor, block: int) -> torch.Tensor:
    """float32 x [rows, cols] with each block of `block` consecutive columns times the
    orthonormal Hadamard matrix of that order: x H, as butterflies (see the module docstring)."""
    rows, cols = x.shape
    values = x.float().reshape(rows, cols // block, block)
    half = 1
    while half < block:
        pairs = values.reshape(rows, cols // block, block // (2 * half), 2, half)
        first, second = pairs[:, :, :, 0], pairs[:, :, :, 1]
        values = torch.stack((first + second, first - second), dim=3)
        half *= 2
    return values.reshape(rows, cols) * torch.tensor(hadamard_norm(block), dtype=torch.float32)


class BlockHadamard(nn.Module):
    """x H over the last dimension of `features` inputs, in the input's dtype (computed in
    float32): H holds the orthonormal Hadamard matrix of order `hadamard_block(features)` down its
    diagonal."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.features = features
        self.block = hadamard_block(features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        turned = walsh_hadamard_rows(x.reshape(-1, self.features), self.block)
        return turned.reshape(x.shape).to(x.dtype)


class HadamardInputs(nn.Module):
    """A float projection whose inputs turn by `hadamard` first; its weight holds W H, so the
    product is the unturned projection's. W8A8 quantizes it into one `W8A8Linear` that turns
    its inputs in the quantization pass."""

    def __init__(self, hadamard: BlockHadamard, projection: nn.Module) -> None:
        super().__init__()
        self.hadamard = hadamard
        self.projection = projection

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.projection(self.hadamard(x))
