"""Each projection form against its plain reference: packed, int8, int4, and the row dispatch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from firsttoken.ops.linear import (
    INT4_GROUP_SIZE,
    QUANTIZED_MAX_ROWS,
    DecodeQuantizedLinear,
    Int4Linear,
    Int8Linear,
    Linear,
    PackedLinear,
    dequantize_int4,
    fastest_linear,
    int4_linear_reference,
    int8_linear_reference,
    quantize_int4,
    quantize_int8,
)

ROW_COUNTS = [1, 4, 8, 33]
# bf16 activations and outputs: one bf16 rounding of each ~0.5-sized output, plus the
# kernels' fp32 sums in their own order.
BF16_OUTPUT_TOLERANCE = dict(atol=2e-2, rtol=2e-2)


def _weight(out_features: int = 96, in_features: int = 128, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(out_features, in_features, generator=generator) * 0.05


@pytest.mark.parametrize("rows", ROW_COUNTS)
def test_packed_linear_is_the_plain_matmul_bit_for_bit(rows):
    weight = _weight().bfloat16()
    x = torch.randn(rows, 128).bfloat16()
    torch.testing.assert_close(PackedLinear(weight, None)(x), F.linear(x, weight), atol=0, rtol=0)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch build")
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


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch build")
def test_the_invariance_probe_catches_a_kernel_that_changes_with_the_row_count(monkeypatch):
    from firsttoken.ops.linear import rows_invariant

    linear = PackedLinear(torch.randn(64, 128).to(torch.bfloat16), None)
    forward = PackedLinear.forward
    monkeypatch.setattr(
        PackedLinear, "forward", lambda self, x: forward(self, x) * (1 + 2**-7 * (x.shape[0] > 64))
    )
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
    dispatch = fastest_linear(linear, quantization, quantized_prefill=False, pack_onednn=True)
    assert isinstance(dispatch, DecodeQuantizedLinear)
    max_rows = QUANTIZED_MAX_ROWS[quantization]
    for rows in (1, max_rows, max_rows + 1, 64):
        x = torch.randn(rows, 128).bfloat16()
        expected_path = dispatch.quantized if rows <= max_rows else dispatch.full_precision
        torch.testing.assert_close(dispatch(x), expected_path(x), atol=0, rtol=0)
    assert isinstance(dispatch.full_precision, PackedLinear)


def test_quantized_prefill_drops_the_float_weights():
    linear = Linear(128, 96, bias=False, dtype=torch.bfloat16)
    linear.weight.data = _weight().bfloat16()
    assert isinstance(fastest_linear(linear, "int4", quantized_prefill=True, pack_onednn=True), Int4Linear)


def test_int4_falls_back_to_int8_without_whole_groups():
    linear = Linear(100, 96, bias=False, dtype=torch.bfloat16)
    linear.weight.data = torch.randn(96, 100).bfloat16()
    assert isinstance(fastest_linear(linear, "int4", quantized_prefill=True, pack_onednn=False), Int8Linear)
