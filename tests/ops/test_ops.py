"""Each op against transformers' own Llama implementation, and each fused op against its reference."""

from __future__ import annotations

import pytest
import torch

from firsttoken.ops.activation import gelu_tanh_and_mul_reference, silu_and_mul_reference
from firsttoken.ops.kernels import FUSED_MIN_TOKENS, Kernels
from firsttoken.ops.norm import add_rms_norm_reference, rms_norm_reference
from firsttoken.ops.rotary import (
    RopeScaling,
    apply_rotary_reference,
    cos_sin_table,
    inverse_frequencies,
    rotary_cos_sin,
)

FUSED = Kernels(fused=True)
# Fused ops round bf16 where the reference does; differences come from fp32 reduction order.
FUSED_TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=1.6e-2)}
TOKEN_COUNTS = [FUSED_MIN_TOKENS - 1, FUSED_MIN_TOKENS, FUSED_MIN_TOKENS + 77]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_reference_is_transformers_rms_norm(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x = torch.randn(37, 576).to(dtype)
    hf = LlamaRMSNorm(576, eps=1e-5).to(dtype)
    hf.weight.data = torch.randn(576).to(dtype)
    torch.testing.assert_close(rms_norm_reference(x, hf.weight.data, 1e-5), hf(x), atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", TOKEN_COUNTS)
def test_fused_norms_match_reference(dtype, num_tokens):
    x, residual = (torch.randn(num_tokens, 576).to(dtype) for _ in range(2))
    weight = torch.randn(576).to(dtype)
    torch.testing.assert_close(
        FUSED.rms_norm(x, weight, 1e-5), rms_norm_reference(x, weight, 1e-5), **FUSED_TOLERANCE[dtype]
    )
    normed, summed = FUSED.add_rms_norm(x, residual, weight, 1e-6)
    expected_normed, expected_summed = add_rms_norm_reference(x, residual, weight, 1e-6)
    torch.testing.assert_close(summed, x + residual, atol=0, rtol=0)
    torch.testing.assert_close(expected_summed, x + residual, atol=0, rtol=0)
    torch.testing.assert_close(normed, expected_normed, **FUSED_TOLERANCE[dtype])


@pytest.mark.parametrize(
    "rope_parameters",
    [
        {"rope_type": "default", "rope_theta": 100000.0},
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ],
)
def test_rotary_reference_matches_transformers(rope_parameters):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    head_dim, num_heads = 64, 4
    config = LlamaConfig(
        hidden_size=head_dim * num_heads, num_attention_heads=num_heads, rope_parameters=rope_parameters,
        max_position_embeddings=32768,
    )
    hf_rope = LlamaRotaryEmbedding(config)
    positions = torch.tensor([0, 1, 5, 100, 4095, 20000])
    x = torch.randn(len(positions), num_heads, head_dim)
    cos, sin = hf_rope(x, positions[None])
    expected, _ = apply_rotary_pos_emb(x.transpose(0, 1)[None], x.transpose(0, 1)[None], cos, sin)
    scaling = None
    if rope_parameters["rope_type"] != "default":
        scaling = RopeScaling(**{k: v for k, v in rope_parameters.items() if k != "rope_theta"})
    table = cos_sin_table(inverse_frequencies(head_dim, rope_parameters["rope_theta"], scaling, None), 20001)
    ours = apply_rotary_reference(x, *rotary_cos_sin(table, positions, x.dtype))
    torch.testing.assert_close(ours, expected[0].transpose(0, 1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", TOKEN_COUNTS)
def test_fused_rotary_matches_reference_on_strided_heads(dtype, num_tokens):
    table = cos_sin_table(inverse_frequencies(64, 10000.0, None, None), 4096)
    positions = torch.randint(0, 4096, (num_tokens,))
    cos, sin = rotary_cos_sin(table, positions, dtype)
    qkv = torch.randn(num_tokens, 15 * 64).to(dtype)
    query_key = qkv[:, : 12 * 64].view(num_tokens, 12, 64)  # rows strided as in the model
    torch.testing.assert_close(
        FUSED.apply_rotary(query_key, cos, sin),
        apply_rotary_reference(query_key, cos, sin),
        **FUSED_TOLERANCE[dtype],
    )


def test_unsupported_rope_type_is_named():
    with pytest.raises(ValueError, match="yarn"):
        RopeScaling(rope_type="yarn")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", TOKEN_COUNTS)
def test_silu_and_mul(dtype, num_tokens):
    gate_up = torch.randn(num_tokens, 2 * 48).to(dtype)
    gate, up = gate_up[:, :48], gate_up[:, 48:]
    expected = torch.nn.functional.silu(gate) * up
    torch.testing.assert_close(silu_and_mul_reference(gate_up), expected, atol=0, rtol=0)
    torch.testing.assert_close(FUSED.silu_and_mul(gate_up), expected, **FUSED_TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", TOKEN_COUNTS)
def test_gelu_tanh_and_mul(dtype, num_tokens):
    from transformers.activations import ACT2FN

    gate_up = torch.randn(num_tokens, 2 * 48).to(dtype)
    gate, up = gate_up[:, :48], gate_up[:, 48:]
    expected = ACT2FN["gelu_pytorch_tanh"](gate) * up  # Gemma's hidden activation
    torch.testing.assert_close(gelu_tanh_and_mul_reference(gate_up), expected, atol=0, rtol=0)
    torch.testing.assert_close(FUSED.gelu_tanh_and_mul(gate_up), expected, **FUSED_TOLERANCE[dtype])
