"""torch's SDPA over the engine's [tokens, heads, head_dim] layout, as both backends call it."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_self_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """[n, heads, D] causal attention of a prompt over its own K/V [n, kv_heads, D]."""
    # [n, heads, D] -> [1, heads, n, D]
    output = F.scaled_dot_product_attention(
        query.transpose(0, 1).unsqueeze(0),
        key.transpose(0, 1).unsqueeze(0),
        value.transpose(0, 1).unsqueeze(0),
        is_causal=True,
        enable_gqa=True,
    )
    return output.squeeze(0).transpose(0, 1)
