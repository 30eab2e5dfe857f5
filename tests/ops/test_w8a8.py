"""W8A8 projections: the per-row activation quantization, the native passes against the torch
ones bit for bit, the projection against its float64 reference, rows that never depend on the
step, and the refusal where oneDNN's int8 sums are not exact."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from firsttoken.ops import native, w8a8
from firsttoken.ops.hadamard import walsh_hadamard
from firsttoken.ops.w8a8 import (
    ACTIVATION_ZERO_POINT,
    quantize_int8,
    quantize_rows,
    w8a8_unsupported_reason,
)
from firsttoken.ops.w8a8_linear import W8A8Linear, rescale_rows, w8a8_linear_reference
from tests.native_builds import ISA_PARAMS, built_kernels

needs_exact_int8 = pytest.mark.skipif(
    w8a8_unsupported_reason(torch.device("cpu")) is not None,
    reason=f"{w8a8_unsupported_reason(torch.device('cpu'))}",
)
DTYPES = [torch.float32, torch.bfloat16]
# Odd widths reach the kernels' scalar tails.
WIDTHS = [576, 1536, 37]


def _activations(rows: int, cols: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(max(rows, 3), cols, generator=generator) * 3
    x[1] = 0  # a zero row
    x[2, 0] = 40  # an outlier sets its row's scale
    return x[:rows].to(dtype)


def test_each_row_gets_its_own_scale_and_levels_within_half_a_step():
    x = _activations(8, 64, torch.float32)
    levels, scales = quantize_rows(x)
    assert levels.dtype == torch.uint8 and scales.shape == (8,)
    assert ((levels.int() - ACTIVATION_ZERO_POINT).abs() <= 127).all()
    assert torch.equal(levels[1], torch.full((64,), ACTIVATION_ZERO_POINT, dtype=torch.uint8))
    assert scales[1] == 1
    assert torch.allclose(scales, x.abs().amax(dim=1).where(scales != 1, torch.tensor(127.0)) / 127)
    restored = (levels.float() - ACTIVATION_ZERO_POINT) * scales[:, None]
    assert ((restored - x).abs() <= scales[:, None] / 2 + 1e-6).all()
    # A row's levels and scale never depend on the other rows.
    alone_levels, alone_scales = quantize_rows(x[5:6])
    assert torch.equal(alone_levels, levels[5:6]) and torch.equal(alone_scales, scales[5:6])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cols", WIDTHS)
def test_native_quantization_gives_the_torch_levels_and_scales(native_kernels, dtype, cols):
    if native_kernels is None:
        pytest.skip("no C compiler: no native kernels")
    x = _activations(300, cols, dtype)
    levels, scales = native_kernels.w8a8.quantize_rows_int8(x)
    expected_levels, expected_scales = quantize_rows(x)
    assert torch.equal(levels, expected_levels)
    assert torch.equal(scales, expected_scales)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "cols, block",
    [(1536, 512), (2048, 1024), (768, 256), (384, 128), (192, 64), (96, 32), (48, 16), (8, 2), (24, 8)],
)
def test_native_quantization_turns_rows_by_the_torch_hadamard_bits(kernels, dtype, cols, block):
    """Blocks of whole vectors take the vectorized butterflies (pairs closer than a vector
    swapped within one), smaller ones the scalar loop: the torch bits either way."""
    x = _activations(300, cols, dtype)
    levels, scales = kernels.w8a8.quantize_rows_int8(x, hadamard_block=block)
    expected_levels, expected_scales = quantize_rows(x, hadamard_block=block)
    assert torch.equal(levels, expected_levels)
    assert torch.equal(scales, expected_scales)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("half, block", [(1536, 512), (37, 1)])
def test_silu_gated_rows_quantize_as_silu_and_mul_s_rows(native_kernels, dtype, half, block):
    """SwiGLU's product made inside the quantization pass: the levels and scales of the product
    silu_and_mul writes, read back (column scales and the Hadamard turn applied after it)."""
    if native_kernels is None:
        pytest.skip("no C compiler: no native kernels")
    gate_up = _activations(97, 2 * half, dtype)
    column_scales = torch.rand(half, generator=torch.Generator().manual_seed(half)) + 0.5
    fused = native_kernels.w8a8.quantize_rows_int8(gate_up, column_scales, block, silu_gated=True)
    product = native_kernels.rows.silu_and_mul(gate_up)
    unfused = native_kernels.w8a8.quantize_rows_int8(product, column_scales, block)
    assert torch.equal(fused[0], unfused[0])
    assert torch.equal(fused[1], unfused[1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cols", [576, 37])
@pytest.mark.parametrize("with_residual", [True, False])
def test_quantizing_in_the_norm_s_pass_gives_the_norm_then_quantization_bits(
    kernels, dtype, cols, with_residual
):
    """rms_norm (after the residual add) quantized in one pass: the levels and scales of the
    norm's stored rows quantized, with column scales and a Hadamard turn, and the sum
    add_rms_norm returns."""
    generator = torch.Generator().manual_seed(cols)
    x, residual = _activations(97, cols, dtype), _activations(97, cols, dtype, seed=1)
    weight = (torch.rand(cols, generator=generator) + 0.5).to(dtype)
    column_scales = torch.rand(cols, generator=generator) + 0.5
    if with_residual:
        normed, expected_sum = kernels.rows.add_rms_norm(x, residual, weight, 1e-5)
    else:
        normed, expected_sum = kernels.rows.rms_norm(x, weight, 1e-5), x
    for scales, block in ((None, 1), (column_scales, 1), (None, 64 if cols % 64 == 0 else 1)):
        levels, row_scales, summed = kernels.w8a8.rms_norm_quantize_int8(
            x, residual if with_residual else None, weight, 1e-5, scales, block
        )
        expected_levels, expected_scales = kernels.w8a8.quantize_rows_int8(normed, scales, block)
        assert torch.equal(levels, expected_levels) and torch.equal(row_scales, expected_scales)
        assert torch.equal(summed, expected_sum)


def test_silu_gated_rows_of_odd_width_are_refused(native_kernels):
    if native_kernels is None:
        pytest.skip("no C compiler: no native kernels")
    with pytest.raises(ValueError, match="even width"):
        native_kernels.w8a8.quantize_rows_int8(torch.randn(4, 65), silu_gated=True)


@pytest.mark.parametrize("block", [3, 1024, 0])
def test_a_hadamard_block_that_does_not_tile_the_inputs_in_powers_of_two_is_refused(native_kernels, block):
    with pytest.raises(ValueError, match=f"a Hadamard block of {block} does not tile 1536 inputs"):
        W8A8Linear.from_float(torch.randn(8, 1536), None, hadamard_block=block)
    if native_kernels is not None:
        with pytest.raises(ValueError, match="does not tile"):
            native_kernels.w8a8.quantize_rows_int8(torch.randn(4, 1536), hadamard_block=block)


def test_a_projection_with_turned_inputs_and_folded_weights_keeps_the_float_product(native_kernels):
    """An outlier input spread over its block by the transform leaves the other inputs more
    levels; the weight holds the transform's inverse, so the product is the unturned one's."""
    generator = torch.Generator().manual_seed(5)
    weight = torch.randn(96, 1536, generator=generator) * 0.05
    x = torch.randn(64, 1536, generator=generator)
    x[:, 9] *= 60
    turned_weight = (weight.double() @ torch.block_diag(*[walsh_hadamard(512)] * 3)).float()
    kernels = native_kernels if native_kernels is not None and native_kernels.w8a8.has_w8a8_matmul else None
    if kernels is None and w8a8_unsupported_reason(torch.device("cpu")) is not None:
        pytest.skip(w8a8_unsupported_reason(torch.device("cpu")))
    plain = W8A8Linear.from_float(weight, None, kernels)
    turned = W8A8Linear.from_float(turned_weight, None, kernels, hadamard_block=512)
    expected = F.linear(x, weight)
    assert (turned(x) - expected).abs().mean() < 0.5 * (plain(x) - expected).abs().mean()
    reference = w8a8_linear_reference(x.double(), *quantize_int8(turned_weight), None, hadamard_block=512)
    torch.testing.assert_close(turned(x).double(), reference, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_native_rescaling_gives_the_torch_bits(native_kernels, dtype, with_bias):
    if native_kernels is None:
        pytest.skip("no C compiler: no native kernels")
    generator = torch.Generator().manual_seed(1)
    sums = torch.randn(70, 37, generator=generator) * 1000
    row_scales = torch.rand(70, generator=generator)
    bias = torch.randn(37, generator=generator) if with_bias else None
    output = native_kernels.rows.rescale_rows(sums, row_scales, bias, dtype)
    assert torch.equal(output, rescale_rows(sums.clone(), row_scales, bias, dtype))


def _linear(with_bias: bool, kernels=None) -> tuple[W8A8Linear, torch.Tensor, torch.Tensor | None]:
    generator = torch.Generator().manual_seed(2)
    weight = torch.randn(96, 128, generator=generator) * 0.05
    bias = torch.randn(96, generator=generator) if with_bias else None
    return W8A8Linear.from_float(weight, bias, kernels), weight, bias


@needs_exact_int8
@pytest.mark.parametrize("rows", [1, 3, 64, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_projection_is_its_integer_product_rescaled(rows, with_bias):
    linear, weight, bias = _linear(with_bias)
    x = _activations(rows, 128, torch.float32, seed=rows)
    expected = w8a8_linear_reference(x.double(), *quantize_int8(weight), bias)
    # The int32 sums are exact; what remains is float32's rounding of the two rescalings.
    torch.testing.assert_close(linear(x).double(), expected, rtol=1e-6, atol=1e-5)
    # Within the quantization error of the float projection: a few percent of its largest output.
    plain = F.linear(x, weight, bias)
    assert (linear(x) - plain).abs().max() <= 0.05 * plain.abs().max()


@needs_exact_int8
@pytest.mark.parametrize("dtype", DTYPES)
def test_native_passes_give_the_torch_passes_bits(native_kernels, dtype):
    if native_kernels is None:
        pytest.skip("no C compiler: no native kernels")
    on_torch, _, _ = _linear(True)
    on_native, _, _ = _linear(True, native_kernels)
    x = _activations(65, 128, dtype)
    output = on_native(x)
    assert output.dtype == dtype
    assert torch.equal(output, on_torch(x))
    assert on_native(x.reshape(5, 13, 128)).shape == (5, 13, 96)


@needs_exact_int8
def test_a_row_has_the_same_bits_at_every_row_count():
    """Integer sums do not depend on the order oneDNN adds them in, whatever kernel or blocking
    it picks for the step's size (AMX tiles from 33 rows on, as its bf16 kernels do too)."""
    linear, _, _ = _linear(True)
    x = _activations(1024, 128, torch.float32, seed=7)
    longest = linear(x)
    for rows in (1, 2, 3, 8, 17, 33, 64, 100, 300):
        assert torch.equal(linear(x[:rows]), longest[:rows])


def test_a_cpu_whose_int8_sums_saturate_is_refused_naming_the_instructions(monkeypatch):
    monkeypatch.setattr(w8a8, "onednn_int8_sums_exact", lambda: False)
    reason = w8a8_unsupported_reason(torch.device("cpu"))
    assert reason is not None and "amx_int8, avx512_vnni, avx_vnni" in reason and "saturate" in reason


def test_other_devices_are_refused():
    assert w8a8_unsupported_reason(torch.device("cuda")) == "w8a8 runs on CPU only, not cuda"


def test_the_exactness_probe_agrees_with_the_cpu_flags():
    """The probe's answer follows from the flags, unless oneDNN is held below them."""
    from firsttoken.ops.cpu_info import cpu_flags

    if "ONEDNN_MAX_CPU_ISA" in os.environ:
        pytest.skip("ONEDNN_MAX_CPU_ISA holds oneDNN below what the CPU has")
    has_dot_products = any(flag in cpu_flags() for flag in w8a8.INT8_DOT_PRODUCT_FLAGS)
    assert w8a8.onednn_int8_sums_exact() is has_dot_products


def test_smoothing_leaves_the_float_product_unchanged():
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(96, 128, generator=generator, dtype=torch.float64) * 0.05
    x = torch.randn(10, 128, generator=generator, dtype=torch.float64)
    x[:, 5] *= 50  # an outlier channel
    factors = w8a8.smoothing_factors(x.abs().amax(dim=0), weight, w8a8.SMOOTHING_ALPHA).double()
    torch.testing.assert_close((x / factors) @ (weight * factors).t(), x @ weight.t())
    # The outlier channel is divided most.
    assert factors.argmax() == 5


@needs_exact_int8
def test_a_smoothed_projection_is_its_reference_and_closer_to_the_float_one(native_kernels):
    """An outlier input channel leaves the other channels few levels; smoothing by the
    calibrated maxima moves part of its range into the weight."""
    generator = torch.Generator().manual_seed(4)
    weight = torch.randn(96, 128, generator=generator) * 0.05
    x = torch.randn(64, 128, generator=generator)
    x[:, 7] *= 60
    plain = W8A8Linear.from_float(weight, None)
    smoothed = W8A8Linear.from_float(weight, None, activation_max=x.abs().amax(dim=0))
    expected = F.linear(x, weight)
    assert (smoothed(x) - expected).abs().mean() < 0.5 * (plain(x) - expected).abs().mean()
    reference = w8a8_linear_reference(
        x.double(), *quantize_int8(weight * 1 / smoothed.input_scales), None, smoothed.input_scales
    )
    torch.testing.assert_close(smoothed(x).double(), reference, rtol=1e-5, atol=1e-4)
    if native_kernels is not None:
        on_native = W8A8Linear.from_float(weight, None, native_kernels, activation_max=x.abs().amax(dim=0))
        assert torch.equal(on_native(x), smoothed(x))


@pytest.fixture(scope="module", params=ISA_PARAMS)
def isa_kernels(request) -> native.NativeKernels:
    built = built_kernels(request.param)
    if built is None:
        pytest.skip("no working C compiler on this machine")
    if not built.w8a8.has_w8a8_matmul:
        pytest.skip(f"the {built.isa} build has no int8 matmul (x86 with AVX2 only)")
    return built


# Shapes of SmolLM2's projections, and odd ones: outputs past a whole panel, an odd input count.
MATMUL_SHAPES = [(960, 576), (3072, 576), (576, 1536), (33, 65), (7, 3)]


@pytest.mark.parametrize("out_features,in_features", MATMUL_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_native_int8_matmul_is_the_integer_product_rescaled(
    isa_kernels, out_features, in_features, dtype
):
    """Exact int32 sums, then oneDNN's scaling order: the bits of oneDNN's path where its sums
    are exact, and within the float32 roundings of the float64 reference everywhere."""
    generator = torch.Generator().manual_seed(out_features + in_features)
    weight = torch.randn(out_features, in_features, generator=generator) * 0.05
    bias = torch.randn(out_features, generator=generator)
    levels, scales = quantize_int8(weight)
    x = _activations(19, in_features, dtype)
    activation_levels, row_scales = isa_kernels.w8a8.quantize_rows_int8(x)
    packed = isa_kernels.w8a8.pack_w8a8_weight(levels)
    output = isa_kernels.w8a8.w8a8_matmul(activation_levels, row_scales, packed, scales, bias, dtype)
    expected = w8a8_linear_reference(x, levels, scales, bias)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(output, expected, rtol=tolerance, atol=tolerance)
    if w8a8.onednn_int8_sums_exact():
        assert torch.equal(output, W8A8Linear(levels, scales, bias)(x))


# Inputs in whole 64-byte tile rows (576, 1536, 1024, 128; 62, zero-padded to 64) and not (65:
# every row on VNNI). 1536 and 1024 inputs take the scaling overlapped with the next tile's sums,
# 1024 with a last panel of 8 outputs.
AMX_SHAPES = [(960, 576), (576, 1536), (40, 1024), (33, 128), (24, 62), (40, 65)]


@pytest.mark.parametrize("out_features,in_features", AMX_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_amx_tiles_give_the_vnni_bits(isa_kernels, out_features, in_features, dtype):
    """AMX-INT8 tiles against the VNNI kernel: the same exact sums and scaling, so the same bits
    at every row count: under one tile (tiles configured to it), rows past the last whole tile
    (their padded copy), up to 512 rows panel by panel and more in blocks of rows, outputs past a
    panel; inputs not in whole 64-byte rows (65) run on VNNI."""
    if not isa_kernels.w8a8.w8a8_matmul_uses_amx:
        pytest.skip(f"the {isa_kernels.isa} build on this CPU has no AMX-INT8 tiles")
    generator = torch.Generator().manual_seed(out_features * in_features)
    levels, scales = quantize_int8(torch.randn(out_features, in_features, generator=generator))
    bias = torch.randn(out_features, generator=generator)
    packed = isa_kernels.w8a8.pack_w8a8_weight(levels)
    x = _activations(600, in_features, dtype, seed=out_features)
    activation_levels, row_scales = isa_kernels.w8a8.quantize_rows_int8(x)
    for rows in (1, 31, 32, 33, 64, 100, 300, 512, 545, 600):
        on_tiles, on_vectors = (
            isa_kernels.w8a8.w8a8_matmul(
                activation_levels[:rows], row_scales[:rows], packed, scales, bias, dtype, use_amx=use_amx
            )
            for use_amx in (True, False)
        )
        assert torch.equal(on_tiles, on_vectors), rows
    expected = w8a8_linear_reference(x, levels, scales, bias)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(on_tiles, expected, rtol=tolerance, atol=tolerance)


# SwiGLU's gate | up projections: SmolLM2's (1536 features of 576 inputs), a last panel of 8
# features (40), fewer features than a panel (8), inputs not in whole tile rows (65).
SWIGLU_SHAPES = [(1536, 576), (40, 128), (8, 64), (48, 65)]


@pytest.mark.parametrize("features,in_features", SWIGLU_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_swiglu_epilogue_gives_silu_and_mul_s_bits(isa_kernels, features, in_features, dtype):
    """Gates paired with their ups in each panel, the epilogue's silu(gate) * up: the bits of
    silu_and_mul over the plain gate | up product, on tiles and on vectors, at every row count."""
    if not isa_kernels.w8a8.w8a8_matmul_makes_swiglu:
        pytest.skip(f"the {isa_kernels.isa} build's int8 matmul makes no SwiGLU product")
    generator = torch.Generator().manual_seed(features + in_features)
    levels, scales = quantize_int8(torch.randn(2 * features, in_features, generator=generator))
    bias = torch.randn(2 * features, generator=generator)
    plain, gated = (isa_kernels.w8a8.pack_w8a8_weight(levels, silu_gated=paired) for paired in (False, True))
    x = _activations(545, in_features, dtype, seed=features)
    activation_levels, row_scales = isa_kernels.w8a8.quantize_rows_int8(x)
    for use_amx in (True, False) if isa_kernels.w8a8.w8a8_matmul_uses_amx else (False,):
        for rows in (1, 31, 33, 100, 545):
            args = (activation_levels[:rows], row_scales[:rows])
            gate_up = isa_kernels.w8a8.w8a8_matmul(*args, plain, scales, bias, dtype, use_amx=use_amx)
            product = isa_kernels.w8a8.w8a8_matmul(
                *args, gated, scales, bias, dtype, use_amx=use_amx, silu_gated=True
            )
            assert product.shape == (rows, features)
            assert torch.equal(product, isa_kernels.rows.silu_and_mul(gate_up)), (use_amx, rows)


# (outputs, inputs, Hadamard block, SwiGLU product out): SmolLM2's four projections (a rotated
# down_proj turned in blocks of 512) and odd ones (an input count not in whole quads, 40 outputs).
PROJECTION_SHAPES = [
    (960, 576, 1, False), (576, 576, 1, False), (3072, 576, 1, True), (576, 1536, 512, False),
    (40, 65, 1, False),
]


@pytest.mark.parametrize("out_features,in_features,block,swiglu", PROJECTION_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_projection_in_one_call_gives_the_two_calls_bits(
    isa_kernels, out_features, in_features, block, swiglu, dtype
):
    """Quantization then matmul in one native call (from plain rows, from SwiGLU's gate | up
    rows, from an RMSNorm with and without a residual): the bits of the two calls, whatever the
    row count, none included."""
    if swiglu and not isa_kernels.w8a8.w8a8_matmul_makes_swiglu:
        pytest.skip(f"the {isa_kernels.isa} build's int8 matmul makes no SwiGLU product")
    generator = torch.Generator().manual_seed(out_features + in_features)
    levels, scales = quantize_int8(torch.randn(out_features, in_features, generator=generator))
    bias = torch.randn(out_features, generator=generator)
    packed = isa_kernels.w8a8.pack_w8a8_weight(levels, silu_gated=swiglu)
    column_scales = torch.rand(in_features, generator=generator) + 0.5 if block == 1 else None
    norm_weight = (torch.rand(in_features, generator=generator) + 0.5).to(dtype)
    x = _activations(100, in_features, dtype, seed=in_features)
    residual = _activations(100, in_features, dtype, seed=in_features + 1)
    gate_up = _activations(100, 2 * in_features, dtype, seed=in_features + 2)

    def two_calls(activation_levels, row_scales):
        return isa_kernels.w8a8.w8a8_matmul(
            activation_levels, row_scales, packed, scales, bias, dtype, silu_gated=swiglu
        )

    for rows in (0, 1, 33, 100):
        quantized = isa_kernels.w8a8.quantize_rows_int8(x[:rows], column_scales, block)
        one_call = isa_kernels.w8a8.w8a8_quantize_matmul(
            x[:rows], packed, scales, bias, column_scales, block, silu_gated=swiglu
        )
        assert torch.equal(one_call, two_calls(*quantized)), rows
        quantized = isa_kernels.w8a8.quantize_rows_int8(gate_up[:rows], column_scales, block, silu_gated=True)
        one_call = isa_kernels.w8a8.w8a8_quantize_matmul(
            gate_up[:rows], packed, scales, bias, column_scales, block,
            silu_gated_inputs=True, silu_gated=swiglu,
        )
        assert torch.equal(one_call, two_calls(*quantized)), rows
        for rows_residual in (residual[:rows], None):
            *quantized, summed = isa_kernels.w8a8.rms_norm_quantize_int8(
                x[:rows], rows_residual, norm_weight, 1e-5, column_scales, block
            )
            one_call, one_call_summed = isa_kernels.w8a8.w8a8_norm_matmul(
                x[:rows], rows_residual, norm_weight, 1e-5, packed, scales, bias, column_scales, block, swiglu
            )
            assert torch.equal(one_call, two_calls(*quantized)), rows
            assert torch.equal(one_call_summed, summed), rows


def test_a_projection_in_one_call_refuses_what_its_passes_refuse(isa_kernels):
    levels, scales = quantize_int8(torch.randn(8, 96))
    packed = isa_kernels.w8a8.pack_w8a8_weight(levels)
    x = torch.randn(4, 96)
    with pytest.raises(ValueError, match="even width, got 95"):
        isa_kernels.w8a8.w8a8_quantize_matmul(
            torch.randn(4, 95), packed, scales, None, silu_gated_inputs=True
        )
    with pytest.raises(ValueError, match="a Hadamard block of 64 does not tile 96 inputs"):
        isa_kernels.w8a8.w8a8_quantize_matmul(x, packed, scales, None, hadamard_block=64)
    with pytest.raises(ValueError, match="a Hadamard block of 64 does not tile 96 inputs"):
        isa_kernels.w8a8.w8a8_norm_matmul(
            x, None, torch.ones(96), 1e-5, packed, scales, None, hadamard_block=64
        )
    odd = quantize_int8(torch.randn(9, 96))
    if isa_kernels.w8a8.w8a8_matmul_makes_swiglu:
        with pytest.raises(ValueError, match="even count, got 9"):
            isa_kernels.w8a8.w8a8_quantize_matmul(
                x, isa_kernels.w8a8.pack_w8a8_weight(odd[0]), odd[1], None, silu_gated=True
            )


def test_swiglu_pairs_need_an_even_count_and_a_build_that_makes_them(isa_kernels):
    levels, _ = quantize_int8(torch.randn(9, 64))
    if not isa_kernels.w8a8.w8a8_matmul_makes_swiglu:
        with pytest.raises(ValueError, match="makes no SwiGLU product"):
            isa_kernels.w8a8.pack_w8a8_weight(levels[:8], silu_gated=True)
        return
    with pytest.raises(ValueError, match="even count, got 9"):
        isa_kernels.w8a8.pack_w8a8_weight(levels, silu_gated=True)


def test_amx_asked_for_without_tiles_is_refused(isa_kernels):
    if isa_kernels.w8a8.w8a8_matmul_uses_amx:
        pytest.skip("this build has AMX-INT8 tiles")
    levels, scales = quantize_int8(torch.randn(16, 64))
    activation_levels, row_scales = isa_kernels.w8a8.quantize_rows_int8(torch.randn(4, 64))
    with pytest.raises(ValueError, match="use_amx"):
        isa_kernels.w8a8.w8a8_matmul(
            activation_levels, row_scales, isa_kernels.w8a8.pack_w8a8_weight(levels), scales, None,
            torch.float32, use_amx=True,
        )


def test_without_exact_onednn_sums_the_projection_takes_the_native_matmul(isa_kernels, monkeypatch):
    """Where oneDNN's int8 sums saturate the native kernels' matmul runs it, and W8A8 is not
    refused: a row's bits are the same at every row count, and where oneDNN is exact here they
    are its bits."""
    on_onednn, weight, bias = _linear(True, isa_kernels)
    monkeypatch.setattr(w8a8, "onednn_int8_sums_exact", lambda: False)
    assert w8a8_unsupported_reason(torch.device("cpu"), isa_kernels) is None
    on_native, _, _ = _linear(True, isa_kernels)
    assert on_native.native_matmul
    x = _activations(300, 128, torch.float32, seed=7)
    longest = on_native(x)
    for rows in (1, 2, 5, 6, 7, 13, 97, 200):
        assert torch.equal(on_native(x[:rows]), longest[:rows])
    if not on_onednn.native_matmul:
        assert torch.equal(longest, on_onednn(x))
