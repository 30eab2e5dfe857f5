"""float32 projections that run some step sizes on the native row matmul (ops/decode_batch_linear.py):
the choice from timings, the routing by rows against each kernel, and an engine's greedy tokens
with every decode batch on the native kernel against one on torch's alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from firsttoken.ops import decode_batch_linear
from firsttoken.ops.decode_batch_linear import DecodeBatchLinear, NativeRows, native_rows_from
from firsttoken.ops.linear import Linear, NativeRowInvariantLinear
from firsttoken.worker import model_loading
from firsttoken.worker.shared_weights import SharedWeightsRegistry
from tests.conftest import FIXED_THREADS, TEST_KV_CACHE_BYTES

# A float32 sum of up to 576 products in another order than torch's.
TOLERANCE = dict(atol=1e-5, rtol=1e-5)


def test_the_native_kernel_takes_the_longest_run_of_rows_it_wins_clearly():
    torch_s = {1: 1.0, 2: 1.0, 4: 2.0, 8: 3.0, 16: 4.0, 32: 5.0}
    native_s = {1: 2.0, 2: 1.5, 4: 1.0, 8: 1.0, 16: 2.0, 32: 6.0}
    assert native_rows_from({rows: (torch_s[rows], native_s[rows]) for rows in torch_s}) == NativeRows(4, 16)
    # A gain of 5% is noise, not a win; nowhere a win: None.
    assert native_rows_from({1: (1.0, 0.95), 4: (1.0, 0.97)}) is None
    # Two runs: the longer one.
    split = {1: (1.0, 0.5), 2: (1.0, 2.0), 4: (1.0, 0.5), 8: (1.0, 0.5), 16: (1.0, 2.0)}
    assert native_rows_from(split) == NativeRows(4, 8)
    assert 6 in NativeRows(4, 8) and 9 not in NativeRows(4, 8)


@pytest.mark.parametrize("bias", [False, True])
def test_each_step_size_gets_the_bits_of_the_kernel_it_is_routed_to(kernels, bias):
    generator = torch.Generator().manual_seed(0)
    linear = Linear(576, 960, bias, torch.float32)
    linear.weight.data = torch.randn(960, 576, generator=generator) / 24
    if bias:
        linear.bias.data = torch.randn(960, generator=generator)
    bias_values = linear.bias.data if bias else None
    native_linear = NativeRowInvariantLinear(linear.weight.data, bias_values, kernels)
    routed = DecodeBatchLinear(linear, native_linear, NativeRows(4, 8))
    for rows in (1, 2, 4, 6, 8, 9, 64):
        x = torch.randn(rows, 576, generator=generator)
        expected = native_linear(x) if rows in NativeRows(4, 8) else F.linear(x, linear.weight, bias_values)
        assert torch.equal(routed(x), expected)
        torch.testing.assert_close(routed(x), F.linear(x, linear.weight, bias_values), **TOLERANCE)
    # Leading dimensions are rows too.
    x = torch.randn(2, 3, 576, generator=generator)
    assert torch.equal(routed(x), native_linear(x.reshape(6, 576)).reshape(2, 3, 960))


def _greedy_batch(model_path: str, native_rows: NativeRows | None, monkeypatch) -> list[list[int]]:
    from firsttoken import LLM, SamplingParams

    asked = []
    monkeypatch.setattr(decode_batch_linear, "_measured_rows", {})
    monkeypatch.setattr(
        decode_batch_linear, "_timed_native_rows", lambda *weights: asked.append(weights) or native_rows
    )
    # Its own prepared weights: an engine alive in this process would lend it its projections.
    monkeypatch.setattr(model_loading, "SHARED_WEIGHTS", SharedWeightsRegistry())
    llm = LLM(
        model_path, dtype="float32", batch_invariant=False, chunk_size=512,
        kv_cache_memory_bytes=TEST_KV_CACHE_BYTES, **FIXED_THREADS,
    )  # fmt: skip
    try:
        prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,"]
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
        assert asked  # every projection went through the choice
        return [output.token_ids for output in outputs]
    finally:
        llm.shutdown()


def test_decode_batches_on_the_native_kernel_keep_the_greedy_tokens(model_path, monkeypatch):
    """Every step of 1 to 32 rows on the native row matmul against every step on torch's."""
    on_native = _greedy_batch(model_path, NativeRows(1, 32), monkeypatch)
    on_torch = _greedy_batch(model_path, None, monkeypatch)
    assert on_native == on_torch


def test_a_shape_is_timed_once_on_its_first_weight_and_each_weight_routes_to_its_own(kernels, monkeypatch):
    timed = []
    monkeypatch.setattr(decode_batch_linear, "_measured_rows", {})
    monkeypatch.setattr(
        decode_batch_linear,
        "_timed_native_rows",
        lambda weight, native_linear: timed.append(weight.data_ptr()) or NativeRows(1, 8),
    )
    generator = torch.Generator().manual_seed(0)
    linears = [Linear(64, 96, False, torch.float32) for _ in range(2)]
    for linear in linears:
        linear.weight.data = torch.randn(96, 64, generator=generator)
    routed = [decode_batch_linear.decode_batch_linear(linear, kernels) for linear in linears]
    assert timed == [linears[0].weight.data_ptr()]
    x = torch.randn(2, 64, generator=generator)
    for linear, module in zip(linears, routed, strict=True):
        assert isinstance(module, DecodeBatchLinear)
        torch.testing.assert_close(module(x), F.linear(x, linear.weight), **TOLERANCE)
