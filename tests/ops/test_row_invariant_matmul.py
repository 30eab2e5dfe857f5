"""The row-invariant float32 matmul (csrc/matmul.c) against torch's F.linear, and the property
it exists for: a row's bits are the same whatever the row count, its place in a tile and the
thread count. Every ISA build this CPU can run."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F


# A float32 sum of up to 1536 products in another order than torch's.
TOLERANCE = dict(atol=1e-5, rtol=1e-5)
# SmolLM2-135M's projections (out, in): fused QKV, o, fused gate/up, down; and shapes whose
# outputs end in a partial panel.
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (50, 70), (17, 3)]


def _weights(out_features: int, in_features: int, bias: bool, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=generator) / in_features**0.5
    return weight, torch.randn(out_features, generator=generator) if bias else None


@pytest.mark.parametrize("out_features,in_features", SHAPES)
@pytest.mark.parametrize("rows", [1, 5, 130])
@pytest.mark.parametrize("bias", [False, True])
def test_float32_weights_match_f_linear(kernels, out_features, in_features, rows, bias):
    weight, bias_values = _weights(out_features, in_features, bias)
    x = torch.randn(rows, in_features)
    packed = kernels.matmul.pack_matmul_weight(weight)
    result = kernels.matmul.row_invariant_matmul(x, packed, bias_values, out_features)
    torch.testing.assert_close(result, F.linear(x, weight, bias_values), **TOLERANCE)


@pytest.mark.parametrize("out_features,in_features", [(960, 576), (17, 3)])
def test_bf16_stored_weights_match_f_linear_on_the_rounded_weights(kernels, out_features, in_features):
    weight, bias = _weights(out_features, in_features, True)
    x = torch.randn(9, in_features)
    packed = kernels.matmul.pack_matmul_weight(weight, torch.bfloat16)
    assert packed.dtype == torch.bfloat16
    expected = F.linear(x, weight.to(torch.bfloat16).float(), bias)
    torch.testing.assert_close(
        kernels.matmul.row_invariant_matmul(x, packed, bias, out_features), expected, **TOLERANCE
    )


def test_strided_rows_give_the_contiguous_result(kernels):
    weight, bias = _weights(64, 40, True)
    wide = torch.randn(7, 100)
    x = wide[:, 30:70]  # rows 100 floats apart
    packed = kernels.matmul.pack_matmul_weight(weight)
    expected = kernels.matmul.row_invariant_matmul(x.contiguous(), packed, bias, 64)
    assert torch.equal(kernels.matmul.row_invariant_matmul(x, packed, bias, 64), expected)


# Up to 60 rows: every tile remainder (tiles of 6 rows on AVX2, 12 on AVX-512) and where two
# threads switch from splitting panels to splitting rows (48 rows); then the rows around each end
# of an L2 block of rows (96 on AVX2, 192 on AVX-512). Every count to 300 is the slow tier's.
ROWS_AROUND_BLOCK_ENDS = [rows for end in (96, 192, 288) for rows in range(end - 12, end + 13)]
COVERING_ROW_COUNTS = sorted({*range(1, 61), *ROWS_AROUND_BLOCK_ENDS, 300})


@pytest.mark.parametrize(
    "row_counts",
    [COVERING_ROW_COUNTS, pytest.param(range(1, 301), marks=pytest.mark.slow)],
    ids=["covering", "all"],
)
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_features,in_features", [(960, 576), (64, 1536), (50, 70)])
def test_a_row_has_the_same_bits_at_every_row_count_and_thread_count(
    kernels, threads, weight_dtype, out_features, in_features, row_counts
):
    """Steps of 1 to 300 rows: every tile remainder, blocks of rows split over threads or not; the
    first rows and the last are compared, so a row is checked at many positions in its tile."""
    weight, bias = _weights(out_features, in_features, True)
    packed = kernels.matmul.pack_matmul_weight(weight, weight_dtype)
    x = torch.randn(300, in_features)
    torch.set_num_threads(1)
    alone = torch.cat(
        [kernels.matmul.row_invariant_matmul(x[r : r + 1], packed, bias, out_features) for r in range(300)]
    )
    for num_threads in (1, 2):
        torch.set_num_threads(num_threads)
        for rows in row_counts:
            together = kernels.matmul.row_invariant_matmul(x[:rows], packed, bias, out_features)
            assert torch.equal(together[:3], alone[: min(rows, 3)]), (num_threads, rows)
            assert torch.equal(together[-2:], alone[max(0, rows - 2) : rows]), (num_threads, rows)
        assert torch.equal(together, alone), num_threads


def test_a_row_keeps_its_bits_wherever_it_sits_in_the_step(kernels, threads):
    """The same input row at each position of a 40-row step (every place in a tile)."""
    weight, bias = _weights(576, 576, True)
    packed = kernels.matmul.pack_matmul_weight(weight)
    row = torch.randn(1, 576)
    expected = kernels.matmul.row_invariant_matmul(row, packed, bias, 576)
    for position in range(40):
        x = torch.randn(40, 576)
        x[position] = row[0]
        assert torch.equal(
            kernels.matmul.row_invariant_matmul(x, packed, bias, 576)[position : position + 1], expected
        )


def test_no_rows_give_an_empty_result(kernels):
    weight, _ = _weights(32, 16, False)
    packed = kernels.matmul.pack_matmul_weight(weight)
    result = kernels.matmul.row_invariant_matmul(torch.empty(0, 16), packed, None, 32)
    assert result.shape == (0, 32)


@pytest.mark.parametrize(
    "change",
    [
        dict(x=torch.randn(3, 15)),
        dict(x=torch.randn(3, 16, dtype=torch.float64)),
        dict(x=torch.randn(16, 3).t()),
        dict(out_features=64),
        dict(bias=torch.randn(31)),
    ],
)
def test_mismatched_arguments_are_an_error_naming_the_shapes(kernels, change):
    weight, bias = _weights(32, 16, True)
    arguments = dict(
        x=torch.randn(3, 16), packed_weight=kernels.matmul.pack_matmul_weight(weight), bias=bias,
        out_features=32,
    )
    with pytest.raises(ValueError, match="row_invariant_matmul: x"):
        kernels.matmul.row_invariant_matmul(**{**arguments, **change})
