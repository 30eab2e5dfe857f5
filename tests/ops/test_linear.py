"""Each projection form against its plain reference: packed, int8, int4, and the row dispatch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from firsttoken.ops.linear import (
    Linear,
    NativeRowInvariantLinear,
    PackedLinear,
    WidenedLinear,
    cpu_computes_bf16,
    row_invariant_linear,
)
from firsttoken.ops.linear_choice import (
    PORTABLE_QUANTIZED_MAX_ROWS,
    QUANTIZED_MAX_ROWS,
    DecodeQuantizedLinear,
    fastest_linear,
)
from firsttoken.ops.native_abi import INT4_GROUP_SIZE
from firsttoken.ops.quantized_linear import (
    Int4Linear,
    Int8Linear,
    PortableInt4Linear,
    dequantize_int4,
    int4_linear_reference,
    int8_linear_reference,
    quantize_int4,
)
from firsttoken.ops.w8a8 import quantize_int8

ROW_COUNTS = [1, 4, 8, 33]
needs_onednn_bf16 = pytest.mark.skipif(
    not cpu_computes_bf16(),
    reason="oneDNN has no bf16 kernels for this CPU (needs AVX512-BF16, AMX or AVX-512 BW/VL/DQ)",
)
# bf16 activations and outputs: one bf16 rounding of each ~0.5-sized output, plus the
# kernels' fp32 sums in their own order.
BF16_OUTPUT_TOLERANCE = dict(atol=2e-2, rtol=2e-2)


def _weight(out_features: int = 96, in_features: int = 128, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(out_features, in_features, generator=generator) * 0.05


@needs_onednn_bf16
@pytest.mark.parametrize("rows", ROW_COUNTS)
def test_packed_linear_is_the_plain_matmul_bit_for_bit(rows):
    weight = _weight().bfloat16()
    x = torch.randn(rows, 128).bfloat16()
    torch.testing.assert_close(PackedLinear(weight, None)(x), F.linear(x, weight), atol=0, rtol=0)


@needs_onednn_bf16
def test_a_padded_single_row_gets_the_bits_it_gets_beside_other_rows():
    from firsttoken.ops.linear import rows_invariant

    generator = torch.Generator().manual_seed(12)
    linear = PackedLinear((torch.randn(576, 1536, generator=generator) * 0.05).to(torch.bfloat16), None)
    linear.pad_single_rows = True
    if not rows_invariant(linear):
        pytest.skip("this CPU's oneDNN kernels change a row's sums with the row count (see rows_invariant)")
    rows = torch.randn(40, 1536, generator=generator).to(torch.bfloat16)
    for batch in (2, 5, 40):
        together = linear(rows[:batch])
        for row in range(0, batch, 3):
            assert torch.equal(linear(rows[row : row + 1]), together[row : row + 1])
    assert linear(rows[0]).shape == (576,)  # a 1-D input keeps its shape


@needs_onednn_bf16
def test_the_invariance_probe_catches_a_kernel_that_changes_with_the_row_count(monkeypatch):
    from firsttoken.ops.linear import rows_invariant

    linear = PackedLinear(torch.randn(64, 128).to(torch.bfloat16), None)
    forward = PackedLinear.forward
    monkeypatch.setattr(
        PackedLinear, "forward", lambda self, x: forward(self, x) * (1 + 2**-7 * (x.shape[0] > 64))
    )
    assert rows_invariant(linear) is False


@needs_onednn_bf16
def test_the_invariance_probe_catches_a_late_row_that_changes_in_larger_steps(monkeypatch):
    """AMX's oneDNN kernels keep the first rows' bits and change a few later ones in some ranges
    of row counts (row 30 of 576 x 1536 from 33 to 512 rows, not at 1024): the probe compares
    every row, not the first ones."""
    from firsttoken.ops.linear import rows_invariant

    linear = PackedLinear(torch.randn(64, 128).to(torch.bfloat16), None)
    forward = PackedLinear.forward

    def row_30_changes_from_33_to_512_rows(self, x):
        output = forward(self, x)
        if 32 < x.shape[0] <= 512:
            output[30] = output[30] * (1 + 2**-7)
        return output

    monkeypatch.setattr(PackedLinear, "forward", row_30_changes_from_33_to_512_rows)
    assert rows_invariant(linear) is False


def test_int8_quantization_error_is_at_most_half_a_step():
    weight = _weight()
    quantized, scales = quantize_int8(weight)
    dequantized = quantized.float() * scales[:, None]
    assert ((dequantized - weight).abs() <= scales[:, None] / 2 + 1e-7).all()


@pytest.mark.parametrize("rows", ROW_COUNTS)
def test_int8_linear_matches_its_reference(rows):
    weight = _weight().bfloat16()
    linear = Int8Linear.from_float(weight, None)
    x = torch.randn(rows, 128).bfloat16()
    expected = int8_linear_reference(x, linear.weight, linear.scales, None)
    torch.testing.assert_close(linear(x), expected, **BF16_OUTPUT_TOLERANCE)


def test_int4_quantization_error_is_at_most_half_a_step():
    weight = _weight()
    levels, scales_and_zeros = quantize_int4(weight)
    assert levels.min() >= 0 and levels.max() <= 15
    step = scales_and_zeros[..., 0].t().repeat_interleave(INT4_GROUP_SIZE, dim=1)
    error = (dequantize_int4(levels, scales_and_zeros, INT4_GROUP_SIZE) - weight).abs()
    assert (error <= step / 2 + 1e-7).all()


def test_int4_requantizes_a_q4_1_tensor_to_its_own_levels():
    """GGUF Q4_1 blocks (w = d * q + m) come back exactly: the int4 path reads what the file holds."""
    weight = _weight(64, 256).numpy()
    stored = dequantize(quantize(weight, GGMLQuantizationType.Q4_1), GGMLQuantizationType.Q4_1)
    stored = torch.from_numpy(np.ascontiguousarray(stored)).reshape(64, 256)
    levels, scales_and_zeros = quantize_int4(stored)
    roundtrip = dequantize_int4(levels, scales_and_zeros, INT4_GROUP_SIZE)
    torch.testing.assert_close(roundtrip, stored, atol=1e-6, rtol=0)


@pytest.mark.parametrize("rows", ROW_COUNTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int4_linear_matches_its_reference(rows, dtype):
    weight = _weight()
    bias = torch.randn(96).to(dtype)
    linear = Int4Linear.from_float(weight.to(dtype), bias)
    levels, scales_and_zeros = quantize_int4(weight.to(dtype))
    x = torch.randn(rows, 128).to(dtype)
    # The kernel reads its scales and zeros in bf16; so does this reference.
    expected = int4_linear_reference(x, levels, scales_and_zeros.bfloat16(), INT4_GROUP_SIZE, bias)
    output = linear(x)
    assert output.dtype == dtype
    torch.testing.assert_close(output, expected, **BF16_OUTPUT_TOLERANCE)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_decode_quantized_linear_takes_quantized_weights_only_for_few_rows(quantization):
    linear = Linear(128, 96, bias=False, dtype=torch.bfloat16)
    linear.weight.data = _weight().bfloat16()
    dispatch = fastest_linear(linear, quantization, quantized_prefill=False, pack_onednn=cpu_computes_bf16())
    assert isinstance(dispatch, DecodeQuantizedLinear)
    max_rows = QUANTIZED_MAX_ROWS[quantization]
    for rows in (1, max_rows, max_rows + 1, 64):
        x = torch.randn(rows, 128).bfloat16()
        expected_path = dispatch.quantized if rows <= max_rows else dispatch.full_precision
        torch.testing.assert_close(dispatch(x), expected_path(x), atol=0, rtol=0)
    assert isinstance(dispatch.full_precision, PackedLinear if cpu_computes_bf16() else WidenedLinear)


@pytest.mark.parametrize("rows", ROW_COUNTS)
def test_a_widened_bf16_projection_rounds_the_float32_product_once(rows):
    """On a CPU without bf16 kernels a bf16 projection sums in float32 and rounds once, as a bf16
    matmul with float32 accumulation does: within one bf16 rounding of torch's own bf16 matmul."""
    weight, bias = _weight().bfloat16(), torch.randn(96).bfloat16()
    x = torch.randn(rows, 128).bfloat16()
    output = WidenedLinear(weight, bias)(x)
    assert output.dtype == torch.bfloat16
    exact = F.linear(x.double(), weight.double(), bias.double())
    # Half a bf16 step of rounding, plus float32's summation error.
    assert ((output.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-5).all()
    torch.testing.assert_close(output, F.linear(x, weight, bias), **BF16_OUTPUT_TOLERANCE)


def test_bf16_projections_widen_exactly_where_onednn_has_no_bf16_kernels():
    linear = Linear(128, 96, bias=False, dtype=torch.bfloat16)
    linear.weight.data = _weight().bfloat16()
    plain = fastest_linear(linear, None, quantized_prefill=False, pack_onednn=False)
    assert isinstance(plain, WidenedLinear) != cpu_computes_bf16()


def test_quantized_prefill_drops_the_float_weights():
    linear = Linear(128, 96, bias=False, dtype=torch.bfloat16)
    linear.weight.data = _weight().bfloat16()
    dropped = fastest_linear(linear, "int4", quantized_prefill=True, pack_onednn=cpu_computes_bf16())
    assert isinstance(dropped, Int4Linear)


def test_a_float32_quantized_projection_takes_larger_steps_on_the_row_invariant_matmul(native_kernels):
    """Past the quantized kernels' rows the float weights run where an unquantized engine's would:
    the native row-invariant matmul, the same bits."""
    kernels = _portable_kernels(native_kernels)
    linear = Linear(128, 96, bias=True, dtype=torch.float32)
    linear.weight.data, linear.bias.data = _weight(), torch.randn(96)
    dispatch = fastest_linear(
        linear, "int4", quantized_prefill=False, pack_onednn=False, native_kernels=kernels,
        row_invariant_float=True,
    )
    assert isinstance(dispatch, DecodeQuantizedLinear)
    assert isinstance(dispatch.full_precision, NativeRowInvariantLinear)
    x = torch.randn(PORTABLE_QUANTIZED_MAX_ROWS + 4, 128)
    assert torch.equal(dispatch(x), row_invariant_linear(linear, kernels)(x))


def test_int4_falls_back_to_int8_without_whole_groups():
    linear = Linear(100, 96, bias=False, dtype=torch.bfloat16)
    linear.weight.data = torch.randn(96, 100).bfloat16()
    assert isinstance(fastest_linear(linear, "int4", quantized_prefill=True, pack_onednn=False), Int8Linear)


def _portable_kernels(native_kernels):
    if native_kernels is None:
        pytest.skip("no C compiler on this machine")
    return native_kernels


@pytest.mark.parametrize("rows", ROW_COUNTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_portable_int4_linear_matches_its_reference(native_kernels, rows, dtype):
    kernels = _portable_kernels(native_kernels)
    weight = _weight()
    bias = torch.randn(96).to(dtype)
    linear = PortableInt4Linear.from_float(weight.to(dtype), bias, kernels)
    levels, scales_and_zeros = quantize_int4(weight.to(dtype))
    x = torch.randn(rows, 128).to(dtype)
    expected = int4_linear_reference(x, levels, scales_and_zeros.bfloat16(), INT4_GROUP_SIZE, bias)
    output = linear(x)
    assert output.dtype == dtype
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else BF16_OUTPUT_TOLERANCE
    torch.testing.assert_close(output, expected, **tolerance)


def test_portable_int4_linear_gives_a_row_its_bits_in_a_step_of_any_size(native_kernels):
    """Past the kernel's rows the step goes through it in pieces; a row never sees the others."""
    linear = PortableInt4Linear.from_float(_weight(), None, _portable_kernels(native_kernels))
    x = torch.randn(2, 19, 128)
    together = linear(x)
    assert together.shape == (2, 19, 96)
    for row in (0, 7, 8, 18):
        assert torch.equal(linear(x[1, row : row + 1]), together[1, row : row + 1])


@pytest.mark.parametrize("rows", ROW_COUNTS)
def test_float32_int8_linear_takes_the_portable_kernel_and_matches_its_reference(native_kernels, rows):
    kernels = _portable_kernels(native_kernels)
    bias = torch.randn(96)
    linear = Int8Linear.from_float(_weight(), bias, kernels)
    assert linear.runs_portable
    x = torch.randn(rows, 128)
    expected = int8_linear_reference(x, linear.weight, linear.scales, bias)
    torch.testing.assert_close(linear(x), expected, atol=1e-5, rtol=1e-5)
    if rows <= PORTABLE_QUANTIZED_MAX_ROWS:
        portable = kernels.quantized.portable_int8_matmul(linear.weight, linear.scales, bias, x)
        assert torch.equal(linear(x), portable)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_float32_projections_take_the_portable_kernels_for_decode_sized_steps(native_kernels, quantization):
    kernels = _portable_kernels(native_kernels)
    linear = Linear(128, 96, bias=False, dtype=torch.float32)
    linear.weight.data = _weight()
    dispatch = fastest_linear(
        linear, quantization, quantized_prefill=False, pack_onednn=False, native_kernels=kernels
    )
    assert isinstance(dispatch.quantized, PortableInt4Linear if quantization == "int4" else Int8Linear)
    assert dispatch.max_quantized_rows == PORTABLE_QUANTIZED_MAX_ROWS
    for rows in (1, PORTABLE_QUANTIZED_MAX_ROWS, PORTABLE_QUANTIZED_MAX_ROWS + 1):
        x = torch.randn(rows, 128)
        expected_path = dispatch.quantized if rows <= PORTABLE_QUANTIZED_MAX_ROWS else dispatch.full_precision
        assert torch.equal(dispatch(x), expected_path(x))
