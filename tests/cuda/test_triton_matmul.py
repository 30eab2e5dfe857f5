"""The row-invariant matmul against torch's, and a row's bits at every row count.

Without a GPU it runs under the Triton interpreter (see tests/cuda/triton_interpreter.py); on
a GPU the same tests run the compiled kernel, where the row-count check is the one that counts.
"""

from __future__ import annotations

import pytest
import torch

from firsttoken.ops.triton_matmul import (
    BLOCK_M,
    _matmul_kernel,
    RowInvariantLinear,
    linear_reference,
    matmul_tiles,
    row_invariant_matmul,
)

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}
ROW_COUNTS = [1, 2, 3, 7, 16, 33, 64, 65, 130]


def _inputs(rows: int, out_features: int, in_features: int, dtype: torch.dtype, device, bias: bool):
    generator = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features, generator=generator).to(dtype).to(device)
    weight = (
        (torch.randn(out_features, in_features, generator=generator) / in_features**0.5).to(dtype).to(device)
    )
    bias_ = torch.randn(out_features, generator=generator).to(dtype).to(device) if bias else None
    return x, weight, bias_


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "out_features,in_features,bias", [(96, 64, False), (200, 80, True), (40, 576, False)]
)
def test_row_invariant_matmul_is_close_to_torch(dtype, out_features, in_features, bias, device):
    x, weight, bias_ = _inputs(37, out_features, in_features, dtype, device, bias)
    out = row_invariant_matmul(x, weight, bias_)
    assert out.dtype == dtype and out.shape == (37, out_features)
    expected = linear_reference(x.float(), weight.float(), bias_.float() if bias else None).to(dtype)
    torch.testing.assert_close(out, expected, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_a_rows_bits_do_not_depend_on_the_row_count(dtype, device):
    x, weight, bias = _inputs(max(ROW_COUNTS), 96, 192, dtype, device, bias=True)
    whole = row_invariant_matmul(x, weight, bias)
    for rows in ROW_COUNTS:
        # The first rows of a smaller batch, and the same rows at the end of a batch (another tile offset).
        assert torch.equal(row_invariant_matmul(x[:rows], weight, bias), whole[:rows]), rows
        assert torch.equal(row_invariant_matmul(x[-rows:], weight, bias), whole[-rows:]), rows


@pytest.mark.skipif(not torch.cuda.is_available(), reason="reads the compiled kernels' cache")
def test_every_row_count_runs_one_binary(device):
    x, weight, bias = _inputs(max(ROW_COUNTS), 96, 192, torch.bfloat16, device, bias=True)
    row_invariant_matmul(x, weight, bias)
    compiled = _matmul_kernel.device_caches[torch.cuda.current_device()][0]
    binaries = set(compiled)
    for rows in ROW_COUNTS:
        row_invariant_matmul(x[:rows], weight, bias)
    assert set(compiled) == binaries


def test_tiles_depend_on_the_weight_only():
    assert matmul_tiles(576, 576, torch.bfloat16).block_n == 16  # narrow: many programs for one row
    assert matmul_tiles(49152, 576, torch.bfloat16).block_n == 128
    assert matmul_tiles(3072, 576, torch.bfloat16).block_k == 64
    assert matmul_tiles(3072, 576, torch.float32).block_k == 32
    assert BLOCK_M == 64


def test_linear_module_keeps_leading_dimensions_and_rejects_a_wrong_width(device):
    x, weight, bias = _inputs(6, 48, 32, torch.bfloat16, device, bias=True)
    linear = RowInvariantLinear(weight, bias)
    out = linear(x.reshape(2, 3, 32))
    assert out.shape == (2, 3, 48) and torch.equal(out.reshape(6, 48), row_invariant_matmul(x, weight, bias))
    assert linear(x[:0]).shape == (0, 48)
    with pytest.raises(ValueError, match="does not match"):
        linear(x[:, :16])
