"""The Triton kernels of the elementwise ops against their references, and the model on them.

Without a GPU they run under the Triton interpreter (see tests/cuda/triton_interpreter.py).
Rotary and SwiGLU round where their references round, so they agree bit for bit; RMSNorm sums
its variance in another order, so it may differ by one unit in the last place of the dtype.
"""

from __future__ import annotations

import pytest
import torch

from firsttoken.ops import triton_ops
from firsttoken.ops.activation import silu_and_mul_reference
from firsttoken.ops.kernels import Kernels
from firsttoken.ops.norm import add_rms_norm_reference, rms_norm_reference
from firsttoken.ops.rotary import apply_rotary_reference, cos_sin_table, inverse_frequencies, rotary_cos_sin

DTYPES = [torch.float32, torch.bfloat16]
# One unit in the last place at the magnitudes these inputs reach (|normed * weight| < 8).
NORM_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3.2e-2}


def _assert_within_one_ulp(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=0, atol=NORM_TOLERANCE[expected.dtype])
    if expected.dtype == torch.bfloat16:  # float32 keeps the variance's last bits; bf16 rounds them off
        assert (actual != expected).float().mean() < 0.02


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden_size", [64, 576, 1000])
def test_rms_norm_and_add_rms_norm_match_the_references(dtype, hidden_size, device):
    torch.manual_seed(hidden_size)
    x = (torch.randn(37, hidden_size) * 3).to(dtype).to(device)
    residual = torch.randn(37, hidden_size).to(dtype).to(device)
    weight = (1 + 0.5 * torch.randn(hidden_size)).to(dtype).to(device)
    _assert_within_one_ulp(triton_ops.rms_norm(x, weight, 1e-5), rms_norm_reference(x, weight, 1e-5))
    normed, summed = triton_ops.add_rms_norm(x, residual, weight, 1e-5)
    expected_normed, expected_summed = add_rms_norm_reference(x, residual, weight, 1e-5)
    assert torch.equal(summed, expected_summed)
    _assert_within_one_ulp(normed, expected_normed)


def test_rms_norm_reads_rows_of_a_strided_view(device):
    wide = torch.randn(9, 200, device=device)
    x = wide[:, :128]  # rows 200 apart
    weight = torch.randn(128, device=device)
    _assert_within_one_ulp(triton_ops.rms_norm(x, weight, 1e-6), rms_norm_reference(x, weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("intermediate", [96, 1536, 2100])
def test_silu_and_mul_matches_the_reference(dtype, intermediate, device):
    torch.manual_seed(intermediate)
    gate_up = (torch.randn(13, 2 * intermediate) * 4).to(dtype).to(device)
    expected = silu_and_mul_reference(gate_up)
    actual = triton_ops.silu_and_mul(gate_up)
    tolerance = 1e-6 if dtype == torch.float32 else 0
    torch.testing.assert_close(actual, expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(9, 3, 64), (4, 4, 96), (32, 8, 128)])
def test_rotary_in_place_matches_the_reference_on_a_qkv_view(
    dtype, num_heads, num_kv_heads, head_dim, device
):
    torch.manual_seed(head_dim)
    num_tokens = 11
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim).to(dtype).to(device)
    # Queries and keys as the model rotates them: a view of the fused projection's output.
    query_key = qkv[:, : (num_heads + num_kv_heads) * head_dim].view(
        num_tokens, num_heads + num_kv_heads, head_dim
    )
    table = cos_sin_table(inverse_frequencies(head_dim, 10000.0, None, None), 4096).to(device)
    positions = torch.tensor([0, 1, 2, 5, 17, 100, 511, 512, 1000, 2047, 4095], device=device)
    cos, sin = rotary_cos_sin(table, positions, dtype)
    expected = apply_rotary_reference(query_key.clone(), cos, sin)
    values_before = qkv[:, (num_heads + num_kv_heads) * head_dim :].clone()
    rotated = triton_ops.apply_rotary_(query_key, cos, sin)
    assert rotated.data_ptr() == query_key.data_ptr()
    if dtype == torch.bfloat16:
        assert torch.equal(rotated, expected)
    else:
        torch.testing.assert_close(rotated, expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(qkv[:, (num_heads + num_kv_heads) * head_dim :], values_before)  # values untouched


def test_empty_steps_launch_nothing(device):
    empty = torch.empty(0, 64, device=device)
    assert triton_ops.rms_norm(empty, torch.ones(64, device=device), 1e-5).shape == (0, 64)
    assert triton_ops.silu_and_mul(torch.empty(0, 128, device=device)).shape == (0, 64)


def test_kernels_choose_the_triton_ops_where_given_and_the_reference_otherwise(device):
    x = torch.randn(5, 64, device=device)
    weight = torch.randn(64, device=device)
    calls = []

    class CountingOps:
        def rms_norm(self, *args):
            calls.append("rms_norm")
            return triton_ops.rms_norm(*args)

    with_triton = Kernels(fused=True, triton_ops=CountingOps())
    with_triton.rms_norm(x, weight, 1e-5)
    Kernels(fused=False, triton_ops=CountingOps()).rms_norm(x, weight, 1e-5)  # fuse_ops off: references
    with_triton.rms_norm(x.t().contiguous().t(), weight, 1e-5)  # columns not unit-stride: reference
    assert calls == ["rms_norm"]
