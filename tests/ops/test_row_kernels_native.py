"""The native row kernels of every ISA build this CPU runs against their torch references: the
norms, and SwiGLU's product (`silu_and_mul`, and the W8A8 quantization pass that makes it itself)."""

from __future__ import annotations

import pytest
import torch

from firsttoken.ops.activation import silu_and_mul_reference
from firsttoken.ops.norm import add_rms_norm_reference, rms_norm_reference

# The kernels round where the references round; what is left is float32 summation order (a
# norm's sum of squares) and each build's e^x, a polynomial of ~2e-7 relative error where
# torch's is correctly rounded: an ulp or two in float32, at most one step in bf16.
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=1.6e-2)}
# Gates where e^-x overflows float32 (x below -88.7), where it is a denormal, and around them.
EXTREME_GATES = [-1e30, -1000.0, -100.0, -89.0, -88.5, -88.0, -87.0, -30.0, 0.0, 30.0, 87.0, 88.0, 89.0, 1e3]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# 100 columns: a tail after whole vectors; 700 rows: split over threads.
@pytest.mark.parametrize("rows, cols", [(1, 576), (3, 100), (130, 576), (700, 576)])
def test_norms_match_reference(kernels, dtype, rows, cols):
    generator = torch.Generator().manual_seed(rows)
    x, residual = (torch.randn(rows, cols, generator=generator).to(dtype) for _ in range(2))
    weight = torch.randn(cols, generator=generator).to(dtype)
    expected = rms_norm_reference(x, weight, 1e-5)
    torch.testing.assert_close(kernels.rows.rms_norm(x, weight, 1e-5), expected, **TOLERANCE[dtype])
    normed, summed = kernels.rows.add_rms_norm(x, residual, weight, 1e-6)
    expected_normed, expected_summed = add_rms_norm_reference(x, residual, weight, 1e-6)
    torch.testing.assert_close(summed, expected_summed, atol=0, rtol=0)
    torch.testing.assert_close(normed, expected_normed, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 130, 700])  # 700: split over threads
def test_silu_and_mul_matches_reference(kernels, dtype, rows):
    gate_up = (4 * torch.randn(rows, 2 * 1536, generator=torch.Generator().manual_seed(rows))).to(dtype)
    torch.testing.assert_close(
        kernels.rows.silu_and_mul(gate_up), silu_and_mul_reference(gate_up), **TOLERANCE[dtype]
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gates_whose_exponential_overflows_give_zero_not_nan(kernels, dtype):
    """A gate below -88.7 makes e^-x infinite: SiLU is 0 there (torch's x / inf), never NaN,
    in the vector lanes and the scalar tail alike (35 columns: two vectors and a tail on AVX2)."""
    gates = torch.tensor(EXTREME_GATES).repeat(3)[:35]
    gate_up = torch.cat([gates, torch.full_like(gates, 2.0)])[None, :].to(dtype)
    product = kernels.rows.silu_and_mul(gate_up)
    assert not product.isnan().any()
    expected = silu_and_mul_reference(gate_up)
    torch.testing.assert_close(product, expected, atol=1e-30, rtol=TOLERANCE[dtype]["rtol"])
    levels, scales = kernels.w8a8.quantize_rows_int8(gate_up, silu_gated=True)
    assert not scales.isnan().any()
    assert torch.equal(levels, kernels.w8a8.quantize_rows_int8(product)[0])
