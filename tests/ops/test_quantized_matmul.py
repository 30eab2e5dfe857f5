"""The portable int4 and int8 decode projections (csrc/quantized_matmul.c), built for every ISA
this CPU runs, against float64 products of the dequantized weights."""

from __future__ import annotations

import pytest
import torch

from firsttoken.ops import native
from firsttoken.ops.quantized_linear import dequantize_int4, pack_int4, quantize_int4
from firsttoken.ops.w8a8 import quantize_int8
from firsttoken.ops.native_abi import DECODE_MAX_ROWS
from tests.native_builds import ISA_PARAMS, built_kernels

DTYPES = [torch.float32, torch.bfloat16]
ROW_COUNTS = [1, 2, 3, 5, DECODE_MAX_ROWS]
# float32: sums of ~600 products of ~0.05 x ~1 in another order than float64's; bf16: one
# rounding of the product and one after the bias, 8 significant bits each.
FLOAT32_TOLERANCE = 2e-5
BF16_RELATIVE_STEP = 2**-7


@pytest.fixture(scope="module", params=ISA_PARAMS)
def kernels(request) -> native.NativeKernels:
    built = built_kernels(request.param)
    if built is None:
        pytest.skip("no C compiler on this machine")
    return built


def _inputs(rows: int, in_features: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    return torch.randn(rows, in_features, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _weight(out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed)) * 0.05


def _assert_close(actual: torch.Tensor, exact: torch.Tensor) -> None:
    """`exact` float64; float32 outputs within a sum's rounding, bf16 within two roundings."""
    error = (actual.double() - exact).abs()
    if actual.dtype == torch.float32:
        assert error.max() <= FLOAT32_TOLERANCE
    else:
        magnitude = exact.abs().clamp(min=exact.abs().max() / 64)
        assert (error <= 2 * BF16_RELATIVE_STEP * magnitude).all()


def _int4_case(out_features: int, in_features: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(levels, scales_zeros) in pack_int4's layout and the float64 weights they stand for."""
    levels, scales_and_zeros = quantize_int4(_weight(out_features, in_features))
    packed, scales_zeros = pack_int4(levels, scales_and_zeros)
    exact = dequantize_int4(levels, scales_and_zeros.bfloat16(), 32).double()
    return packed, scales_zeros, exact


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROW_COUNTS)
@pytest.mark.parametrize("with_bias", [False, True])
def test_int4_matmul_matches_the_dequantized_weights(kernels, dtype, rows, with_bias):
    # 103 outputs: whole tiles of 4 and 2 and a remainder; 96 inputs: three groups.
    packed, scales_zeros, exact_weight = _int4_case(103, 96)
    bias = torch.randn(103).to(dtype) if with_bias else None
    x = _inputs(rows, 96, dtype)
    out = kernels.quantized.portable_int4_matmul(packed, scales_zeros, bias, x)
    assert out.dtype == dtype and out.shape == (rows, 103)
    product = x.double() @ exact_weight.t()
    if dtype == torch.bfloat16:
        product = product.to(dtype).double()  # torch rounds the matmul before adding the bias
    _assert_close(out, product + (bias.double() if with_bias else 0))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROW_COUNTS)
@pytest.mark.parametrize("with_bias", [False, True])
def test_int8_matmul_matches_the_dequantized_weights(kernels, dtype, rows, with_bias):
    weight, scales = quantize_int8(_weight(101, 160))
    scales = scales.to(dtype)
    bias = torch.randn(101).to(dtype) if with_bias else None
    x = _inputs(rows, 160, dtype)
    out = kernels.quantized.portable_int8_matmul(weight, scales, bias, x)
    assert out.dtype == dtype and out.shape == (rows, 101)
    product = x.double() @ (weight.double() * scales.double()[:, None]).t()
    if dtype == torch.bfloat16:
        product = product.to(dtype).double()
    _assert_close(out, product + (bias.double() if with_bias else 0))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_gets_the_same_bits_at_every_row_count(kernels, dtype):
    """Batch invariance: each row alone and beside 1 to 7 others (every tile width), bit for bit;
    SmolLM2's qkv shape, large enough to split over threads."""
    packed, scales_zeros, _ = _int4_case(960, 576)
    weight, scales = quantize_int8(_weight(960, 576))
    scales = scales.to(dtype)
    x = _inputs(DECODE_MAX_ROWS, 576, dtype)
    for matmul in (
        lambda rows: kernels.quantized.portable_int4_matmul(packed, scales_zeros, None, rows),
        lambda rows: kernels.quantized.portable_int8_matmul(weight, scales, None, rows),
    ):
        alone = [matmul(x[row : row + 1]) for row in range(DECODE_MAX_ROWS)]
        for rows in range(2, DECODE_MAX_ROWS + 1):
            together = matmul(x[:rows])
            for row in range(rows):
                assert torch.equal(together[row : row + 1], alone[row])


def test_int4_sums_do_not_depend_on_the_thread_count(kernels):
    packed, scales_zeros, _ = _int4_case(960, 576)
    x = _inputs(4, 576, torch.float32)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = kernels.quantized.portable_int4_matmul(packed, scales_zeros, None, x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(kernels.quantized.portable_int4_matmul(packed, scales_zeros, None, x), single)


def test_bad_shapes_and_dtypes_are_errors_naming_the_kernel(kernels):
    packed, scales_zeros, _ = _int4_case(8, 64)
    with pytest.raises(ValueError, match="portable_int4_matmul: 9 rows"):
        kernels.quantized.portable_int4_matmul(
            packed, scales_zeros, None, _inputs(DECODE_MAX_ROWS + 1, 64, torch.float32)
        )
    with pytest.raises(ValueError, match="portable_int4_matmul: 1 rows of 32"):
        kernels.quantized.portable_int4_matmul(packed, scales_zeros, None, _inputs(1, 32, torch.float32))
    with pytest.raises(ValueError, match="bias"):
        kernels.quantized.portable_int4_matmul(
            packed, scales_zeros, torch.zeros(8), _inputs(1, 64, torch.bfloat16)
        )
    weight, scales = quantize_int8(_weight(8, 24))
    with pytest.raises(ValueError, match="portable_int8_matmul: 1 rows of 24"):
        kernels.quantized.portable_int8_matmul(weight, scales, None, _inputs(1, 24, torch.float32))
    with pytest.raises(ValueError, match="scales"):
        kernels.quantized.portable_int8_matmul(weight, scales, None, _inputs(1, 24, torch.bfloat16))
