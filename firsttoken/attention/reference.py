"""Plain-math paged attention and KV write: the definitions every fast backend is tested against."""

from __future__ import annotations

import torch

from firsttoken.attention.backend import PLAIN_ATTENTION, BatchLayout, LayerAttention


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
    layer: LayerAttention = PLAIN_ATTENTION,
    sink_query: torch.Tensor | None = None,  # as query, with layer.sink_tokens
) -> torch.Tensor:
    """Each sequence's queries attend causally to their context read from the cache, in float32:
    within `layer`'s sliding window, scores soft-capped where it caps them, and with its sinks
    (StreamingLLM) the first keys too once a query's window has left them, scored with its row
    of `sink_query`; one softmax over sinks and window."""
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
        rows = slice(row, row + sequence.query_len)
        query_positions = torch.arange(sequence.num_context_tokens, sequence.seq_len)
        first_keys = window_starts(query_positions, layer)
        key_positions = torch.arange(sequence.seq_len)
        allowed = (key_positions[None, :] <= query_positions[:, None]) & (
            key_positions[None, :] >= first_keys[:, None]
        )
        scores = _scores(query[rows], keys, layer)
        if layer.sink_tokens:
            sinks = slice(0, layer.sink_tokens)
            scores = torch.cat([_scores(sink_query[rows], keys[sinks], layer), scores], dim=-1)
            takes_sinks = (first_keys > 0)[:, None].expand(-1, layer.sink_tokens)
            allowed = torch.cat([takes_sinks, allowed], dim=-1)
            values = torch.cat([values[sinks], values])
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        outputs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), values))
        row += sequence.query_len
    return torch.cat(outputs).to(query.dtype)


def window_starts(positions: torch.Tensor, layer: LayerAttention) -> torch.Tensor:
    """The first key each query at `positions` sees in its window: 0 without a window, and 0
    while the window still reaches past the sinks (a query sees every key up to its own then)."""
    if layer.sliding_window is None:
        return torch.zeros_like(positions)
    starts = (positions - layer.sliding_window + 1).clamp(min=0)
    return torch.where(starts <= layer.sink_tokens, 0, starts)


def _scores(query: torch.Tensor, keys: torch.Tensor, layer: LayerAttention) -> torch.Tensor:
    """[heads, queries, keys] scaled dot products in float32, soft-capped where `layer` caps them."""
    scores = torch.einsum("qhd,khd->hqk", query.float(), keys) / query.shape[-1] ** 0.5
    if layer.logit_softcap is not None:
        scores = torch.tanh(scores / layer.logit_softcap) * layer.logit_softcap
    return scores
