"""Each op against transformers' own Llama implementation of the same step."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from firsttoken.ops.activation import silu_and_mul, silu_and_mul_reference
from firsttoken.ops.norm import add_rms_norm, rms_norm, rms_norm_reference
from firsttoken.ops.rotary import RopeScaling, apply_rotary, apply_rotary_reference, cos_sin_table, inverse_frequencies


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_transformers(dtype):
    x = torch.randn(37, 576).to(dtype)
    hf = LlamaRMSNorm(576, eps=1e-5).to(dtype)
    hf.weight.data = torch.randn(576).to(dtype)
    expected = hf(x)
    torch.testing.assert_close(rms_norm_reference(x, hf.weight.data, 1e-5), expected, atol=0, rtol=0)
    torch.testing.assert_close(rms_norm(x, hf.weight.data, 1e-5), expected, atol=1e-5, rtol=1e-2)


def test_add_rms_norm_returns_norm_of_sum_and_the_sum():
    x, residual, weight = torch.randn(5, 64), torch.randn(5, 64), torch.randn(64)
    normed, summed = add_rms_norm(x, residual, weight, 1e-6)
    torch.testing.assert_close(summed, x + residual)
    torch.testing.assert_close(normed, rms_norm_reference(x + residual, weight, 1e-6))


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
def test_rotary_matches_transformers(rope_parameters):
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
    ours = apply_rotary_reference(x, positions, table)
    torch.testing.assert_close(ours, expected[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(apply_rotary(x, positions, table), ours, atol=1e-5, rtol=1e-5)


def test_unsupported_rope_type_is_named():
    with pytest.raises(ValueError, match="yarn"):
        RopeScaling(rope_type="yarn")


def test_silu_and_mul():
    gate_up = torch.randn(7, 2 * 48)
    gate, up = gate_up[:, :48], gate_up[:, 48:]
    expected = torch.nn.functional.silu(gate) * up
    torch.testing.assert_close(silu_and_mul_reference(gate_up), expected)
    torch.testing.assert_close(silu_and_mul(gate_up), expected)
