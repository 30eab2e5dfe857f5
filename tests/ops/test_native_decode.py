"""The native int4/int8 projections and the whole-step native decodes (bf16 on AVX512-BF16
builds, float32 on every build) against the per-op path."""

from __future__ import annotations

import pytest
import torch

from firsttoken.attention.backend import BatchLayout, SequenceLayout
from firsttoken.attention.cpu_backend import CPUAttentionBackend
from firsttoken.models.arch import ModelArch
from firsttoken.models.llama import LlamaForCausalLM
from firsttoken.ops.kernels import Kernels
from firsttoken.ops.quantized_linear import (
    Int8Linear,
    NativeInt4Linear,
    dequantize_int4,
    pack_int4,
    quantize_int4,
    unpack_int4,
)
from firsttoken.ops.native_abi import DECODE_MAX_ROWS
from firsttoken.ops.rotary import RopeScaling
from firsttoken.worker.kv_cache import allocate_kv_caches
from firsttoken.worker.whole_step_decode import build_whole_step_decode
from firsttoken.worker.whole_step_layers import whole_step_unsupported_reason


@pytest.fixture
def int4_kernels(native_kernels):
    if native_kernels is None or not native_kernels.has_decode_kernels:
        pytest.skip("no native int4 kernels on this machine (needs a C compiler and AVX512-BF16)")
    return native_kernels


def _bf16_close(actual: torch.Tensor, product: torch.Tensor, bias: torch.Tensor | None) -> None:
    """Within a few bf16 roundings of the float64 result: the product rounds once, and again
    after the bias (bf16 keeps 8 significant bits)."""
    magnitude = product.abs().clamp(min=product.abs().max() / 64)
    exact = product
    if bias is not None:
        exact = product + bias.double()
        magnitude = magnitude + bias.double().abs()
    assert ((actual.double() - exact).abs() <= 2 * magnitude / 128).all()


def test_int4_packing_round_trips():
    weight = torch.randn(48, 128)
    levels, scales_and_zeros = quantize_int4(weight)
    unpacked_levels, unpacked_scales = unpack_int4(*pack_int4(levels, scales_and_zeros))
    assert torch.equal(unpacked_levels, levels)
    assert torch.equal(unpacked_scales, scales_and_zeros.to(torch.bfloat16).float())


@pytest.mark.parametrize("in_features", [64, 576, 1536])
@pytest.mark.parametrize("rows", [1, 3, 8, 12])
@pytest.mark.parametrize("with_bias", [False, True])
def test_native_int4_linear_matches_dequantized_weights(int4_kernels, in_features, rows, with_bias):
    generator = torch.Generator().manual_seed(in_features + rows)
    weight = torch.randn(200, in_features, generator=generator) * 0.05
    bias = torch.randn(200, generator=generator).to(torch.bfloat16) if with_bias else None
    linear = NativeInt4Linear.from_float(weight, bias, int4_kernels)
    x = torch.randn(rows, in_features, generator=generator).to(torch.bfloat16)
    levels, scales_and_zeros = unpack_int4(linear.levels, linear.scales_zeros)
    dequantized = dequantize_int4(levels, scales_and_zeros, 32).double()
    if rows > DECODE_MAX_ROWS:  # past the kernel's rows: a bf16 matmul on the dequantized weights
        dequantized = dequantized.to(torch.bfloat16).double()
    _bf16_close(linear(x), x.double() @ dequantized.t(), bias)


def test_native_int4_matmul_names_a_bad_shape(int4_kernels):
    linear = NativeInt4Linear.from_float(torch.randn(8, 128), None, int4_kernels)
    with pytest.raises(ValueError, match="int4_matmul: 1 rows of 64 inputs"):
        int4_kernels.quantized.int4_matmul(
            linear.levels, linear.scales_zeros, None, torch.zeros(1, 64, dtype=torch.bfloat16)
        )


@pytest.mark.parametrize("rows", [1, 5, 8])
@pytest.mark.parametrize("with_bias", [False, True])
def test_native_int8_linear_matches_torch_kernel(int4_kernels, rows, with_bias):
    generator = torch.Generator().manual_seed(rows)
    weight = (torch.randn(300, 576, generator=generator) * 0.05).to(torch.bfloat16)
    bias = torch.randn(300, generator=generator).to(torch.bfloat16) if with_bias else None
    linear = Int8Linear.from_float(weight, bias, int4_kernels)
    assert linear.kernels is not None
    x = torch.randn(rows, 576, generator=generator).to(torch.bfloat16)
    product = x.double() @ (linear.weight.double() * linear.scales.double()[:, None]).t()
    _bf16_close(linear(x), product, bias)
    torch_kernel = torch.ops.aten._weight_int8pack_mm(x, linear.weight, linear.scales)
    if bias is not None:
        torch_kernel = torch_kernel + bias
    # Same weights and roundings: at most one bf16 step apart (float32 summation order).
    assert ((linear(x).float() - torch_kernel.float()).abs() <= torch_kernel.float().abs() / 128 + 1e-6).all()


def _arch(
    head_dim: int,
    num_heads: int,
    num_kv_heads: int,
    attention_bias: bool,
    qk_norm: bool = False,
    sliding_window: int | None = None,
    **fields,
) -> ModelArch:
    return ModelArch(
        architecture="llama",
        vocab_size=256,
        hidden_size=128,
        intermediate_size=192,
        num_layers=2,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        attention_bias=attention_bias,
        qk_norm=qk_norm,
        sliding_window=sliding_window,
        **fields,
    )


# Phi-4-mini's and Llama's rarer layers: three quarters of each head rotating, LongRoPE (long
# factors: the model's 256 positions pass the original 64) and biases on every projection.
PARTIAL_LONGROPE_BIASED = dict(
    attention_output_bias=True,
    mlp_bias=True,
    rotary_dim=48,
    rope_scaling=RopeScaling(
        "longrope",
        original_max_position_embeddings=64,
        short_factor=tuple(1.0 + index / 8 for index in range(24)),
        long_factor=tuple(1.0 + index for index in range(24)),
        attention_factor=1.2,
    ),
)


BLOCK_SIZE = 4
NUM_BLOCKS = 16


def _int4_model(
    arch: ModelArch, kernels, quantization: str | None = "int4", dtype: torch.dtype = torch.bfloat16
) -> LlamaForCausalLM:
    backend = CPUAttentionBackend(torch.device("cpu"), kernels)
    model = LlamaForCausalLM(arch, backend, Kernels(fused=True, native_kernels=kernels), dtype, 256)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            parameter.copy_(1 + 0.1 * noise if "norm" in name else 0.2 * noise)
    model.prepare_projections(quantization, quantized_prefill=False, pack_onednn=False)
    caches = allocate_kv_caches(arch, NUM_BLOCKS, BLOCK_SIZE, dtype, torch.device("cpu"))
    for cache in caches:
        cache.copy_(torch.randn(cache.shape, generator=generator))
    model.bind_kv_caches(caches)
    return model


# Scattered, shuffled blocks; lengths include the new token.
SEQUENCES = {
    "batch": [(5, [7, 2]), (9, [0, 11, 5]), (1, [9])],
    "lone": [(14, [3, 4, 5, 6])],
}


def _decode_inputs(sequences):
    """input_ids, positions, slot_mapping and layout of a decode-only step."""
    layout = BatchLayout(
        [SequenceLayout(1, seq_len - 1, blocks) for seq_len, blocks in sequences], len(sequences), BLOCK_SIZE
    )
    positions = torch.tensor([seq_len - 1 for seq_len, _ in sequences])
    slot_mapping = torch.tensor(
        [
            blocks[(seq_len - 1) // BLOCK_SIZE] * BLOCK_SIZE + (seq_len - 1) % BLOCK_SIZE
            for seq_len, blocks in sequences
        ]
    )
    input_ids = torch.arange(len(sequences)) * 31 + 7
    return input_ids, positions, slot_mapping, layout


@pytest.mark.parametrize(
    "head_dim, num_heads, num_kv_heads, attention_bias",
    [(32, 4, 2, False), (64, 6, 2, True), (128, 2, 1, False)],
    ids=["d32-gqa2", "d64-gqa3-bias", "d128"],
)
@pytest.mark.parametrize("sequences", SEQUENCES.values(), ids=SEQUENCES.keys())
@torch.inference_mode()
def test_native_decode_step_matches_the_per_op_layers(
    int4_kernels, head_dim, num_heads, num_kv_heads, attention_bias, sequences
):
    model = _int4_model(_arch(head_dim, num_heads, num_kv_heads, attention_bias), int4_kernels)
    _assert_bf16_step_matches_the_per_op_layers(model, sequences)


@pytest.mark.parametrize("sequences", SEQUENCES.values(), ids=SEQUENCES.keys())
@torch.inference_mode()
def test_native_decode_step_of_partial_rotary_longrope_and_biases_matches_the_per_op_layers(
    int4_kernels, sequences
):
    model = _int4_model(_arch(64, 6, 2, True, **PARTIAL_LONGROPE_BIASED), int4_kernels)
    _assert_bf16_step_matches_the_per_op_layers(model, sequences)


def _assert_bf16_step_matches_the_per_op_layers(model: LlamaForCausalLM, sequences) -> None:
    whole_step = build_whole_step_decode(model)
    assert whole_step is not None
    caches = [layer.self_attn.kv_cache for layer in model.layers]
    before = [cache.clone() for cache in caches]
    input_ids, positions, slot_mapping, layout = _decode_inputs(sequences)
    assert whole_step.takes(layout)

    native_hidden = whole_step.run(input_ids, positions, slot_mapping, layout)
    native_caches = [cache.clone() for cache in caches]
    for cache, saved in zip(caches, before):
        cache.copy_(saved)
    metadata = model.layers[0].self_attn.backend.build_metadata(layout, slot_mapping)
    per_op_hidden = model(input_ids, positions, metadata)

    # The new K/V are the same bits (same int4 kernel, same rotary); nothing else is written.
    for native_cache, cache in zip(native_caches, caches):
        assert torch.equal(native_cache, cache)
    # Attention sums in another order than SDPA: bf16 outputs a rounding or two apart.
    scale = per_op_hidden.float().abs().max()
    assert (native_hidden.float() - per_op_hidden.float()).abs().max() <= 0.02 * scale


def _assert_a_block_outside_the_cache_is_refused(model: LlamaForCausalLM) -> None:
    """The whole step raises naming the cache and writes no cache."""
    whole_step = build_whole_step_decode(model)
    caches = [layer.self_attn.kv_cache.clone() for layer in model.layers]
    input_ids, positions, slot_mapping, layout = _decode_inputs(SEQUENCES["lone"])
    (sequence,) = layout.sequences
    # The slot stays in the cache; the block table's last entry is one past the last block.
    outside = SequenceLayout(1, sequence.num_context_tokens, sequence.block_table[:-1] + [NUM_BLOCKS])
    with pytest.raises(IndexError, match="outside the KV cache"):
        whole_step.run(input_ids, positions, slot_mapping, BatchLayout([outside], 1, BLOCK_SIZE))
    for layer, cache in zip(model.layers, caches):
        assert torch.equal(layer.self_attn.kv_cache, cache)


def test_the_bf16_decode_step_leaves_sliding_windows_to_the_per_op_path(int4_kernels):
    """Its paged attention reads every key: a windowed model's bf16 int4 decode runs op by op."""
    windowed = _int4_model(_arch(32, 4, 2, False, sliding_window=5), int4_kernels)
    assert whole_step_unsupported_reason(windowed) is None
    assert build_whole_step_decode(windowed) is None


@torch.inference_mode()
def test_native_decode_step_rejects_a_block_outside_the_cache(int4_kernels):
    _assert_a_block_outside_the_cache_is_refused(_int4_model(_arch(32, 4, 2, False), int4_kernels))


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_native_decode_needs_int4_projections(int4_kernels, quantization):
    assert build_whole_step_decode(_int4_model(_arch(32, 4, 2, False), int4_kernels, quantization)) is None


@pytest.fixture
def portable_kernels(native_kernels):
    if native_kernels is None:
        pytest.skip("no native kernels on this machine (needs a C compiler)")
    return native_kernels


def _per_op_step(model: LlamaForCausalLM, sequences) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The step's hidden states through the model's own forward, and the caches it leaves; the
    caches are put back as they were."""
    caches = [layer.self_attn.kv_cache for layer in model.layers]
    before = [cache.clone() for cache in caches]
    input_ids, positions, slot_mapping, layout = _decode_inputs(sequences)
    metadata = model.layers[0].self_attn.backend.build_metadata(layout, slot_mapping)
    hidden = model(input_ids, positions, metadata)
    written = [cache.clone() for cache in caches]
    for cache, saved in zip(caches, before):
        cache.copy_(saved)
    return hidden, written


def _assert_whole_step_gives_the_per_op_bits(model: LlamaForCausalLM, sequences) -> None:
    """The whole step's hidden states and new K/V equal the model's own forward's, bit for bit."""
    whole_step = build_whole_step_decode(model)
    assert whole_step is not None
    per_op_hidden, per_op_caches = _per_op_step(model, sequences)
    input_ids, positions, slot_mapping, layout = _decode_inputs(sequences)
    assert whole_step.takes(layout)
    assert torch.equal(whole_step.run(input_ids, positions, slot_mapping, layout), per_op_hidden)
    for layer, per_op_cache in zip(model.layers, per_op_caches):
        assert torch.equal(layer.self_attn.kv_cache, per_op_cache)


@pytest.mark.parametrize(
    "head_dim, num_heads, num_kv_heads, attention_bias",
    [(32, 4, 2, False), (64, 6, 2, True), (128, 2, 1, False)],
    ids=["d32-gqa2", "d64-gqa3-bias", "d128"],
)
@pytest.mark.parametrize("sequences", SEQUENCES.values(), ids=SEQUENCES.keys())
@torch.inference_mode()
def test_float32_decode_step_gives_the_per_op_bits(
    portable_kernels, head_dim, num_heads, num_kv_heads, attention_bias, sequences
):
    """The portable step runs the per-op path's kernels in one call: the same hidden states
    and the same new K/V, bit for bit, and nothing else written."""
    model = _int4_model(
        _arch(head_dim, num_heads, num_kv_heads, attention_bias), portable_kernels, dtype=torch.float32
    )
    _assert_whole_step_gives_the_per_op_bits(model, sequences)


@pytest.mark.parametrize("sequences", SEQUENCES.values(), ids=SEQUENCES.keys())
@torch.inference_mode()
def test_float32_decode_step_of_partial_rotary_longrope_and_biases_gives_the_per_op_bits(
    portable_kernels, sequences
):
    """The rotary table carries partial rotary and LongRoPE, the projections their biases:
    the whole step, on full-head rotary kernels, gives the per-op bits."""
    arch = _arch(64, 6, 2, True, **PARTIAL_LONGROPE_BIASED)
    model = _int4_model(arch, portable_kernels, dtype=torch.float32)
    _assert_whole_step_gives_the_per_op_bits(model, sequences)


@pytest.mark.parametrize("sequences", SEQUENCES.values(), ids=SEQUENCES.keys())
@torch.inference_mode()
def test_float32_decode_step_attends_within_each_layers_window_with_the_per_op_bits(
    portable_kernels, sequences
):
    """A window of 5 keys, shorter than most sequences here: the whole step reads what the per-op
    path's flash decode reads, to the bit."""
    model = _int4_model(_arch(32, 4, 2, False, sliding_window=5), portable_kernels, dtype=torch.float32)
    _assert_whole_step_gives_the_per_op_bits(model, sequences)


@torch.inference_mode()
def test_float32_decode_step_rejects_a_block_outside_the_cache(portable_kernels):
    model = _int4_model(_arch(32, 4, 2, False), portable_kernels, dtype=torch.float32)
    _assert_a_block_outside_the_cache_is_refused(model)


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_float32_decode_step_needs_int4_projections(portable_kernels, quantization):
    model = _int4_model(_arch(32, 4, 2, False), portable_kernels, quantization, dtype=torch.float32)
    assert build_whole_step_decode(model) is None


def test_query_key_norms_are_left_to_the_per_op_path(portable_kernels):
    """Qwen3 normalizes each query and key head before rotary; the native steps do not, so no
    whole step runs such a model, and a plain one of the same weights may."""
    model = _int4_model(_arch(32, 4, 2, False, qk_norm=True), portable_kernels, dtype=torch.float32)
    assert "query/key norms" in whole_step_unsupported_reason(model)
    plain = _int4_model(_arch(32, 4, 2, False), portable_kernels, dtype=torch.float32)
    assert whole_step_unsupported_reason(plain) is None
