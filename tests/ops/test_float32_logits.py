"""The bf16 LM head with float32 logits: its sums against float32 math, a row's logits the same
bits at any row count (on tiles and on vectors), and the head an unquantized bf16 engine picks."""

from __future__ import annotations

import pytest
import torch

from firsttoken.ops.linear import Float32LogitsHead, Linear, PackedLinear
from firsttoken.ops.linear_choice import head_linear

VOCAB, HIDDEN = 1000, 576  # 1000: a last panel of 8 outputs


def _kernels_or_skip(native_kernels):
    if native_kernels is None or not native_kernels.matmul.has_float32_logits:
        pytest.skip("no float32 logits kernel on this machine (needs a C compiler and AVX512-BF16)")
    return native_kernels


def _forms(kernels) -> list[bool]:
    """use_amx values this machine runs: vectors always, tiles where the CPU has them."""
    return [False, True] if kernels.has_amx else [False]


def _head(seed: int = 0) -> torch.Tensor:
    return (torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(seed)) / 8).to(torch.bfloat16)


def _rows(count: int, seed: int = 1) -> torch.Tensor:
    return (torch.randn(count, HIDDEN, generator=torch.Generator().manual_seed(seed)) * 4).to(torch.bfloat16)


@pytest.mark.parametrize("rows", [1, 7, 16, 17, 40])
def test_float32_logits_are_float32_sums_of_the_bf16_products(native_kernels, rows):
    kernels = _kernels_or_skip(native_kernels)
    weight, x = _head(), _rows(rows)
    packed = kernels.matmul.pack_logits_weight(weight)
    expected = x.double() @ weight.double().T
    for use_amx in _forms(kernels):
        logits = kernels.matmul.float32_logits(x, packed, VOCAB, use_amx)
        assert logits.dtype == torch.float32 and logits.shape == (rows, VOCAB)
        # float32 sums of 576 products: far inside bf16's step (1/128 of a logit near 1)
        torch.testing.assert_close(logits.double(), expected, atol=1e-4, rtol=1e-5)
    bf16_grid = expected.to(torch.bfloat16).double()
    assert not torch.equal(kernels.matmul.float32_logits(x, packed, VOCAB).double(), bf16_grid)


def test_a_rows_logits_are_the_same_bits_alone_and_in_any_batch(native_kernels):
    kernels = _kernels_or_skip(native_kernels)
    packed = kernels.matmul.pack_logits_weight(_head())
    x = _rows(37)
    for use_amx in _forms(kernels):
        batched = kernels.matmul.float32_logits(x, packed, VOCAB, use_amx)
        for row in (0, 15, 16, 31, 36):
            alone = kernels.matmul.float32_logits(x[row : row + 1], packed, VOCAB, use_amx)
            assert torch.equal(alone[0], batched[row]), (use_amx, row)
        assert torch.equal(kernels.matmul.float32_logits(x[8:24], packed, VOCAB, use_amx), batched[8:24])


def test_float32_logits_refuse_what_they_cannot_take(native_kernels):
    kernels = _kernels_or_skip(native_kernels)
    with pytest.raises(ValueError, match="divisible by 4"):
        kernels.matmul.pack_logits_weight(torch.zeros(16, 30, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bf16 weights"):
        kernels.matmul.pack_logits_weight(torch.zeros(16, 32))
    packed = kernels.matmul.pack_logits_weight(_head())
    with pytest.raises(ValueError, match="for a head of 1100 outputs"):
        kernels.matmul.float32_logits(_rows(2), packed, 1100)
    if not kernels.has_amx:
        with pytest.raises(ValueError, match="no AMX"):
            kernels.matmul.float32_logits(_rows(2), packed, VOCAB, use_amx=True)


def test_an_unquantized_bf16_head_takes_float32_logits_and_others_keep_theirs(native_kernels):
    kernels = _kernels_or_skip(native_kernels)
    bf16_head = Linear(HIDDEN, VOCAB, False, torch.bfloat16)
    bf16_head.weight.data = _head()
    head = head_linear(bf16_head, True, kernels, False)
    assert isinstance(head, Float32LogitsHead)
    x = _rows(3)
    packed = kernels.matmul.pack_logits_weight(_head())
    assert torch.equal(head(x), kernels.matmul.float32_logits(x, packed, VOCAB))
    float32_head = Linear(HIDDEN, VOCAB, False, torch.float32)
    assert not isinstance(head_linear(float32_head, True, kernels, False), Float32LogitsHead)
    biased = Linear(HIDDEN, VOCAB, True, torch.bfloat16)
    assert isinstance(head_linear(biased, True, kernels, False), PackedLinear)
    assert isinstance(head_linear(bf16_head, True, None, False), PackedLinear)
