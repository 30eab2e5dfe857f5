"""Plain-math paged attention and KV write: the definitions every fast backend is tested against."""

from __future__ import annotations

import torch

from firsttoken.attention.backend import BatchLayout


def write_kv_reference(
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    key: torch.Tensor,  # [T, num_kv_heads, head_dim]
    value: torch.Tensor,  # [T, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [T], any integer dtype
) -> None:
    """Store a step's K/V at their slots (block_id * block_size + offset)."""
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    slots = slot_mapping.long()
    kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slots, key)
    kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slots, value)


def paged_attention_reference(
    query: torch.Tensor,  # [T, num_heads, head_dim], rows in layout order
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim], K/V already written
    layout: BatchLayout,
) -> torch.Tensor:
    """Each sequence's queries attend causally to its whole context read from the cache, in float32."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = kv_cache.shape[-2]
    group = num_heads // num_kv_heads
    outputs = []
    row = 0
    for sequence in layout.sequences:
        slots = torch.tensor(
            [
                sequence.block_table[position // layout.block_size] * layout.block_size
                + position % layout.block_size
                for position in range(sequence.seq_len)
            ],
            dtype=torch.long,
        )
        keys = kv_cache[0].reshape(-1, num_kv_heads, head_dim)[slots].float().repeat_interleave(group, dim=1)
        values = (
            kv_cache[1].reshape(-1, num_kv_heads, head_dim)[slots].float().repeat_interleave(group, dim=1)
        )
        queries = query[row : row + sequence.query_len].float()
        scores = torch.einsum("qhd,khd->hqk", queries, keys) / head_dim**0.5
        query_positions = torch.arange(sequence.num_context_tokens, sequence.seq_len)
        allowed = torch.arange(sequence.seq_len)[None, :] <= query_positions[:, None]
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        outputs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), values))
        row += sequence.query_len
    return torch.cat(outputs).to(query.dtype)
