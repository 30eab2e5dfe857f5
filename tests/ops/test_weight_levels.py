"""A float32 weight's GGUF block levels (ops/weight_levels.py, csrc/weight_levels.c) and the
row-invariant matmul on them (csrc/matmul.c): levels are found only where they rebuild every
weight's bits, and a step on the levels gives the float32 form's bits, on every ISA build this
CPU can run."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from firsttoken.ops import native_abi
from firsttoken.ops.linear import NativeRowInvariantLinear
from firsttoken.ops.weight_levels import pack_levels

# GGUF block types whose dequantized values are levels, with the levels' width.
LEVEL_BITS = {GGMLQuantizationType.Q4_0: 4, GGMLQuantizationType.Q4_1: 4, GGMLQuantizationType.Q8_0: 8}
# (out, in): SmolLM2-135M's fused QKV and down projections; a partial panel on every ISA.
SHAPES = [(960, 576), (576, 1536), (50, 64)]
Q4_K_BLOCK = 256


def gguf_weight(
    blocks: GGMLQuantizationType, out_features: int, in_features: int, seed: int = 0
) -> torch.Tensor:
    """A random weight as llama.cpp's quantizer stores it in `blocks`, dequantized by gguf-py."""
    values = np.random.default_rng(seed).standard_normal((out_features, in_features)).astype(np.float32)
    return torch.from_numpy(
        dequantize(quantize(values * in_features**-0.5, blocks), blocks).astype(np.float32)
    )


def q4_k_weight(out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    """Random Q4_K blocks (fp16 d and dmin, 6-bit scales and mins per group of 32) whose groups
    hold levels as llama.cpp's quantizer leaves them: the least value at level 0, the most at 15
    or a level or two below; dequantized by gguf-py. gguf-py has no Q4_K quantizer."""
    rng = np.random.default_rng(seed)
    num_blocks = out_features * in_features // Q4_K_BLOCK
    halves = rng.uniform(1e-4, 2e-3, (num_blocks, 2)).astype(np.float16)  # d, dmin
    scales_and_mins = rng.integers(0, 256, (num_blocks, 12), dtype=np.uint8)
    levels = rng.integers(0, 16, (num_blocks, 8, 32), dtype=np.uint8)
    levels[:, :, 0] = 0
    levels[:, :, 1] = rng.integers(13, 16, (num_blocks, 8))
    # Bytes of each 32 hold group 2j in their low nibbles and group 2j + 1 in their high ones.
    packed = levels[:, 0::2] | (levels[:, 1::2] << 4)
    blocks = np.concatenate([halves.view(np.uint8), scales_and_mins, packed.reshape(num_blocks, -1)], axis=1)
    dequantized = dequantize(blocks.reshape(out_features, -1), GGMLQuantizationType.Q4_K)
    return torch.from_numpy(dequantized.astype(np.float32))


def test_q4_k_groups_are_4_bit_levels_with_their_17_bit_scales_and_offsets(kernels):
    weight = q4_k_weight(64, 512)
    levels = kernels.matmul.find_levels(weight)
    assert levels is not None and levels.bits == 4
    assert torch.equal(levels.dequantized().view(torch.int32), weight.view(torch.int32))


@pytest.mark.parametrize("blocks", list(LEVEL_BITS), ids=lambda blocks: blocks.name)
def test_levels_rebuild_every_bit_of_a_gguf_dequantized_weight(kernels, blocks):
    weight = gguf_weight(blocks, 96, 128)
    levels = kernels.matmul.find_levels(weight)
    assert levels is not None and levels.bits == LEVEL_BITS[blocks]
    # Every value, bit for bit but a zero's sign (Q4_0 gives -0.0 where its scale is negative),
    # which no FMA chain started from +0 can see.
    rebuilt = levels.dequantized()
    assert torch.equal(rebuilt[weight != 0].view(torch.int32), weight[weight != 0].view(torch.int32))
    assert not rebuilt[weight == 0].any()


def test_a_constant_group_has_scale_zero(kernels):
    weight = gguf_weight(GGMLQuantizationType.Q4_1, 8, 64)
    weight[3, 32:] = weight[3, 40].half().float()  # as Q4_1 stores one: all at its offset
    levels = kernels.matmul.find_levels(weight)
    assert levels is not None and levels.scales[3, 1] == 0
    assert torch.equal(levels.dequantized(), weight)


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(64, 128),
        lambda: torch.randn(64, 128).to(torch.bfloat16).float(),
        lambda: gguf_weight(GGMLQuantizationType.Q4_1, 64, 96)[:, :80],
        lambda: gguf_weight(GGMLQuantizationType.Q4_1, 64, 128).double(),
    ],
    ids=["random", "bf16-rounded", "in-not-a-multiple-of-32", "float64"],
)
def test_weights_of_no_block_grid_have_no_levels(kernels, make):
    assert kernels.matmul.find_levels(make()) is None


def test_one_value_off_the_grid_leaves_the_weight_without_levels(kernels):
    """Even in rows past the ones tried first."""
    weight = gguf_weight(GGMLQuantizationType.Q4_1, 200, 64)
    weight[150, 7] = torch.nextafter(weight[150, 7], torch.tensor(1.0))
    assert kernels.matmul.find_levels(weight) is None
    weight[150, 7] = float("nan")
    assert kernels.matmul.find_levels(weight) is None


def assert_levels_steps_give_float32_bits(kernels, weight: torch.Tensor, bias: bool) -> None:
    """Every row count the levels take, on one thread and two."""
    out_features, in_features = weight.shape
    bias_values = torch.randn(out_features) if bias else None
    packed_float = kernels.matmul.pack_matmul_weight(weight)
    packed_levels = pack_levels(kernels.matmul.find_levels(weight), kernels.matmul.matmul_panel_width)
    x = torch.randn(native_abi.LEVELS_MAX_ROWS, in_features)
    for num_threads in (1, 2):
        torch.set_num_threads(num_threads)
        for rows in range(1, native_abi.LEVELS_MAX_ROWS + 1):
            expected = kernels.matmul.row_invariant_matmul(x[:rows], packed_float, bias_values, out_features)
            result = kernels.matmul.row_invariant_levels_matmul(
                x[:rows], packed_levels, bias_values, out_features
            )
            assert torch.equal(result, expected), (num_threads, rows)


@pytest.mark.parametrize(
    "blocks", [GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0], ids=lambda b: b.name
)
@pytest.mark.parametrize("out_features,in_features", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_a_step_on_the_levels_is_the_bits_of_the_float32_matmul(
    kernels, threads, blocks, out_features, in_features, bias
):
    assert_levels_steps_give_float32_bits(kernels, gguf_weight(blocks, out_features, in_features), bias)


@pytest.mark.parametrize("out_features", [960, 50])
def test_a_step_on_q4_k_levels_is_the_bits_of_the_float32_matmul(kernels, threads, out_features):
    assert_levels_steps_give_float32_bits(kernels, q4_k_weight(out_features, 2 * Q4_K_BLOCK), bias=True)


def test_a_step_of_more_rows_than_the_levels_take_is_an_error_naming_the_limit(kernels):
    weight = gguf_weight(GGMLQuantizationType.Q4_1, 64, 64)
    packed = pack_levels(kernels.matmul.find_levels(weight), kernels.matmul.matmul_panel_width)
    rows = native_abi.LEVELS_MAX_ROWS + 1
    with pytest.raises(ValueError, match=f"at most {native_abi.LEVELS_MAX_ROWS} rows"):
        kernels.matmul.row_invariant_levels_matmul(torch.randn(rows, 64), packed, None, 64)


def test_a_projection_reads_levels_for_decode_sized_steps_and_floats_past_them(kernels):
    """The module's choice by row count, each row the bits of the float32 form; shown by
    emptying one form after the other."""
    weight = gguf_weight(GGMLQuantizationType.Q4_1, 576, 576)
    projection = NativeRowInvariantLinear(weight, None, kernels)
    assert projection.levels is not None and projection.levels.bits == 4
    decode_rows = native_abi.LEVELS_MAX_ROWS
    x = torch.randn(3 * decode_rows, 576)
    expected = torch.cat(
        [kernels.matmul.row_invariant_matmul(row[None], projection.packed_weight, None, 576) for row in x]
    )
    assert torch.equal(projection(x), expected)
    projection.packed_weight.zero_()
    assert torch.equal(projection(x[:decode_rows]), expected[:decode_rows])
    assert not projection(x).any()
    assert NativeRowInvariantLinear(torch.randn(576, 576), None, kernels).levels is None
