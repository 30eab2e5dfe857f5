"""GPTQ's rounding against rounding to nearest: the same levels where the inputs do not
co-vary, a smaller error of the product where they do, and W8A8's own scales and level range."""

from __future__ import annotations

import torch

from firsttoken.ops.gptq import gptq_int8
from firsttoken.ops.w8a8 import INT8_LEVELS, quantize_int8

OUT_FEATURES, IN_FEATURES, ROWS = 48, 320, 2048


def _weight(seed: int = 0) -> torch.Tensor:
    return torch.randn(OUT_FEATURES, IN_FEATURES, generator=torch.Generator().manual_seed(seed))


def _correlated_inputs(seed: int = 1) -> torch.Tensor:
    """Rows whose channels co-vary (a few shared factors) and differ in scale, as a layer's
    normed hidden states do."""
    generator = torch.Generator().manual_seed(seed)
    factors = torch.randn(ROWS, 16, generator=generator, dtype=torch.float64)
    mixing = torch.randn(16, IN_FEATURES, generator=generator, dtype=torch.float64)
    noise = 0.1 * torch.randn(ROWS, IN_FEATURES, generator=generator, dtype=torch.float64)
    channel_scales = torch.rand(IN_FEATURES, generator=generator, dtype=torch.float64) * 3 + 0.1
    return (factors @ mixing + noise) * channel_scales


def _product_error(
    x: torch.Tensor, weight: torch.Tensor, levels: torch.Tensor, scales: torch.Tensor
) -> float:
    rounded = levels.double() * scales.double()[:, None]
    return float(torch.linalg.norm(x @ (weight.double() - rounded).t()))


def test_inputs_that_do_not_co_vary_leave_nothing_to_compensate_so_levels_are_the_nearest():
    weight = _weight()
    moments = torch.diag(torch.rand(IN_FEATURES, dtype=torch.float64) + 0.5)
    gptq = gptq_int8(weight, moments)
    levels, scales = quantize_int8(weight)
    assert torch.equal(gptq.levels, levels)
    assert torch.equal(gptq.scales, scales)


def test_on_co_varying_inputs_the_product_errs_less_than_with_the_nearest_levels():
    weight, x = _weight(), _correlated_inputs()
    gptq = gptq_int8(weight, x.t() @ x)
    nearest_levels, nearest_scales = quantize_int8(weight)
    gptq_error = _product_error(x, weight, gptq.levels, gptq.scales)
    nearest_error = _product_error(x, weight, nearest_levels, nearest_scales)
    # Measured: 0.21x the nearest levels' error on these inputs.
    assert gptq_error < 0.6 * nearest_error
    # The same scales and level range: the result runs on the W8A8 kernels as it is.
    assert torch.equal(gptq.scales, nearest_scales)
    assert gptq.levels.dtype == torch.int8
    assert int(gptq.levels.abs().max()) <= INT8_LEVELS


def test_a_channel_that_never_varied_gets_zero_weights():
    weight, x = _weight(), _correlated_inputs()
    x[:, 5] = 0
    gptq = gptq_int8(weight, x.t() @ x)
    assert torch.equal(gptq.levels[:, 5], torch.zeros(OUT_FEATURES, dtype=torch.int8))
    assert gptq.levels[:, 4].abs().sum() > 0
