"""GPTQ's rounding of a projection's weights to W8A8's int8 levels (Frantar et al., 2022).

Rounding each weight to its nearest level (`firsttoken.ops.w8a8.quantize_int8`) makes each
error as small as it can be, but not the error of the product with real inputs. GPTQ rounds the
columns one at a time and moves each column's rounding error onto the columns not yet rounded,
weighted by how the inputs co-vary (the inverse of their second moments X^T X over a calibration
text), so that the product with such inputs errs least. The levels and per-output-channel scales
are W8A8's own: the result runs on the same kernels as rounded-to-nearest weights.
"""

from __future__ import annotations

import torch

from firsttoken.ops.w8a8 import INT8_LEVELS, Int8Weight, int8_weight_scales

# Added to the second moments' diagonal, as a share of its mean: keeps their inverse defined
# where an input channel barely varies (the paper's 1%; 0.1% gave the same quality on SmolLM2).
DAMPENING = 0.01
# Columns rounded between two updates of the rest of the weight (the paper's lazy batches): the
# same result as one column at a time, in fewer, larger products.
BLOCK_COLUMNS = 128


def gptq_int8(weight: torch.Tensor, second_moments: torch.Tensor) -> Int8Weight:
    """`weight` [out, in] on symmetric per-output-channel int8 levels (each row's scale: its
    largest magnitude / 127, as rounding to nearest has), rounded by GPTQ for inputs whose
    second moments are `second_moments` [in, in]. Input channels that never varied (a zero
    diagonal) get zero weights: they contribute nothing to the product. Computes in float64."""
    # float32 scales, as rounding to nearest stores them, used as they are stored.
    scales = int8_weight_scales(weight).double()
    weight = weight.detach().double().clone()
    moments = second_moments.to(weight.device, torch.float64).clone()
    dead = torch.diagonal(moments) == 0
    moments[dead, dead] = 1
    weight[:, dead] = 0
    moments.diagonal().add_(DAMPENING * torch.diagonal(moments).mean())
    # Row j of the inverse's upper Cholesky factor: how the later columns absorb column j's error.
    inverse_cholesky = torch.linalg.cholesky(
        torch.cholesky_inverse(torch.linalg.cholesky(moments)), upper=True
    )
    levels = torch.empty(weight.shape, dtype=torch.float64, device=weight.device)
    for start in range(0, weight.shape[1], BLOCK_COLUMNS):
        end = min(start + BLOCK_COLUMNS, weight.shape[1])
        # The block's columns as contiguous rows: each step reads one and updates the rest in
        # one rank-1 product (a third less time than column slices of the weight).
        block = weight[:, start:end].t().contiguous()
        block_cholesky = inverse_cholesky[start:end, start:end]
        block_levels = levels[:, start:end].t()
        scaled_errors = torch.empty_like(block)
        for column in range(end - start):
            current = block[column]
            column_levels = torch.round(current / scales).clamp_(-INT8_LEVELS, INT8_LEVELS)
            block_levels[column] = column_levels
            scaled_error = scaled_errors[column]
            torch.sub(current, column_levels * scales, out=scaled_error).div_(block_cholesky[column, column])
            block[column:].addr_(block_cholesky[column, column:], scaled_error, alpha=-1)
        weight[:, end:] -= scaled_errors.t() @ inverse_cholesky[start:end, end:]
    return Int8Weight(levels.to(torch.int8), scales.float())
