"""A row-invariant matmul in Triton: y = x W^T (+ b), where row i's bits never depend on how
many rows x has. Reference: `torch.nn.functional.linear` (`linear_reference`).

cuBLAS picks its kernel, its tiles and often a split of the reduction over K by the problem's
shape, so the same row multiplied in a batch of 1 and in a batch of 300 may be summed in
another order and round differently. Here the launch is fixed by the weight alone:

- one tile configuration (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) chosen from N, K and the
  dtype, never from M, and the row count is not specialized on, so every M runs one binary;
- no split-K: each program walks the whole K range, BLOCK_K at a time, in the same order,
  accumulating in float32, and rounds once at the end;
- a row's output depends only on that row of x and on W: the other rows of its tile (other
  requests, or masked padding past M) are other rows of the same tensor-core product.

The price is decode speed where cuBLAS would split K to fill the GPU with one row: BLOCK_N
shrinks for narrow weights so that even one row runs on many programs.

Runs under `TRITON_INTERPRET=1` on CPU tensors, which is how CI tests it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import nn

BLOCK_M = 64  # rows of x per program, whatever M is
_MIN_BLOCK_N, _MAX_BLOCK_N = 16, 128
# Column tiles to aim for: about one per streaming multiprocessor of a large GPU, so a
# one-row (decode) step still reads the weight on many of them.
_TARGET_COLUMN_TILES = 128
_BLOCK_K_BYTES = 128  # a K tile's row is one 128-byte line


@dataclass(frozen=True)
class MatmulTiles:
    """The launch configuration of one weight shape; a function of N, K and the dtype only."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def matmul_tiles(out_features: int, in_features: int, dtype: torch.dtype) -> MatmulTiles:
    """The tiles of a [out_features, in_features] weight in `dtype` (never of the row count)."""
    block_n = triton.next_power_of_2(max(1, out_features // _TARGET_COLUMN_TILES))
    block_n = min(_MAX_BLOCK_N, max(_MIN_BLOCK_N, block_n))
    block_k = min(_BLOCK_K_BYTES // dtype.itemsize, max(16, triton.next_power_of_2(in_features)))
    return MatmulTiles(block_n, block_k, num_warps=4, num_stages=3 if dtype.itemsize == 2 else 2)


@triton.jit(do_not_specialize=["num_rows"])
def _matmul_kernel(
    x_ptr,
    weight_ptr,
    bias_ptr,
    out_ptr,
    num_rows,
    N: tl.constexpr,
    K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    columns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_valid = rows < num_rows
    column_valid = columns < N
    depth = tl.arange(0, BLOCK_K)
    accumulator = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    # The one reduction order: K tiles from 0 up, each summed by the tensor cores into float32.
    for k_start in range(0, K, BLOCK_K):
        k = k_start + depth
        k_valid = k < K
        x = tl.load(
            x_ptr + rows[:, None] * K + k[None, :], mask=row_valid[:, None] & k_valid[None, :], other=0.0
        )
        weight = tl.load(
            weight_ptr + columns[None, :].to(tl.int64) * K + k[:, None],
            mask=k_valid[:, None] & column_valid[None, :],
            other=0.0,
        )  # [BLOCK_K, BLOCK_N]: W^T's tile
        accumulator = tl.dot(x, weight, accumulator, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        accumulator += tl.load(bias_ptr + columns, mask=column_valid, other=0.0).to(tl.float32)[None, :]
    tl.store(
        out_ptr + rows[:, None] * N + columns[None, :],
        accumulator.to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None] & column_valid[None, :],
    )


def row_invariant_matmul(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., K] times weight [N, K] transposed (+ bias [N]) -> [..., N] in x's dtype."""
    out_features, in_features = weight.shape
    if x.shape[-1] != in_features:
        raise ValueError(f"x: last dimension {x.shape[-1]} does not match the weight's {in_features} inputs")
    leading = x.shape[:-1]
    flat = x.reshape(-1, in_features)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    out = torch.empty((flat.shape[0], out_features), dtype=x.dtype, device=x.device)
    if flat.shape[0] == 0:
        return out.reshape(*leading, out_features)
    tiles = matmul_tiles(out_features, in_features, weight.dtype)
    grid = (triton.cdiv(flat.shape[0], BLOCK_M), triton.cdiv(out_features, tiles.block_n))
    _matmul_kernel[grid](
        flat,
        weight,
        bias if bias is not None else weight,
        out,
        flat.shape[0],
        N=out_features,
        K=in_features,
        BLOCK_M=BLOCK_M,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        HAS_BIAS=bias is not None,
        # float32 stays exact, as torch's default matmul; 16-bit inputs take the tensor cores.
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    return out.reshape(*leading, out_features)


def linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


class RowInvariantLinear(nn.Module):
    """A projection on `row_invariant_matmul`: owns its contiguous weight [N, K] and bias."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
        self.bias = nn.Parameter(bias.contiguous(), requires_grad=False) if bias is not None else None

    @classmethod
    def from_linear(cls, linear: nn.Module) -> RowInvariantLinear:
        """The same weights (shared, not copied) as a float `linear` (a `firsttoken.ops.linear.Linear`)."""
        return cls(linear.weight.data, linear.bias.data if linear.bias is not None else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return row_invariant_matmul(x, self.weight, self.bias)
