"""Paged attention on the CPU: native kernels where they apply, PyTorch's fused
scaled-dot-product (SDPA) kernels elsewhere; flash-style throughout, no score matrix.

- With native kernels, a step's K/V go into the cache in one call instead of two index copies.
- bf16 on AVX512-BF16: decode rows attend in one native call that reads the paged cache in
  place (no gather, no padding, each row alone: the same bits whatever else the step holds;
  with `decode_as_prefill`, the prefill kernel's arithmetic, so a position's bits do not depend
  on whether a decode or a prefill computed it), and prefills on the native prefill kernel.
- Where those kernels do not apply (float32 on any CPU, bf16 without AVX512-BF16), the
  portable flash kernel (csrc/attention.c) takes decode rows, each with the bits a prefill
  gives its position, prefills, and chunks on cached context (read in place, scattered blocks
  too); long chunks take SDPA unless decode rows need a prefill's bits.
- On SDPA (no native kernels, or a long chunk): a prefill with no cached context attends to its own fresh
  K/V (causal), no cache read; a prefill on top of cached context (a prefix-cache hit or an
  earlier chunk) runs two fused calls, one over the cached context (no mask) and one causal
  over the new tokens, merged with their log-sum-exps, so no [query, context] mask is ever
  built; decodes are batched, their contexts gathered through the block tables, padded to the
  longest, and masked.
- A context whose blocks are one run of consecutive block ids (the pool hands out ascending
  runs) is read in place, as a view of the cache: no per-layer copy of the context.
- A layer with a sliding window (each query sees its last `sliding_window` keys) or soft-capped
  scores (Gemma 2) runs on the AVX512-BF16/AMX kernels where they apply (prefills, and decode
  rows with the prefill's arithmetic), from the key block holding its first query's window: the
  blocks the KV cache manager has freed before it are never read. StreamingLLM's sinks, and
  such layers where those kernels do not apply, run every row on the portable flash kernel,
  which skips the key tiles before a row's window too; without native kernels, SDPA with a band
  mask, or plain math for soft-capped scores.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from firsttoken.arithmetic import ceil_div
from firsttoken.attention.backend import PLAIN_ATTENTION, BatchLayout, LayerAttention, decode_tables
from firsttoken.attention.reference import write_kv_reference
from firsttoken.attention.sdpa import causal_self_attention
from firsttoken.ops import native, native_abi, native_library
from firsttoken.ops.native_step_inputs import DecodeTables


# Longer chunks take SDPA unless decode rows must get a prefill's bits, where nothing was
# measured (worker/flash_limit.py measures it where it matters): on some CPUs its GEMM-based
# flash kernel overtakes the portable one past about a thousand queries.
FLASH_MAX_QUERIES_BESIDE_SDPA = 1024


@dataclass
class PrefillSpan:
    """One prefill chunk: rows [query_start, query_start + query_len) of the batch."""

    query_start: int
    query_len: int
    num_context_tokens: int
    context_first_block: int | None  # set when the context's blocks are consecutive ids
    # Set when the blocks of context and new tokens together are consecutive ids.
    sequence_first_block: int | None = None
    # Otherwise, with context: every block of the sequence, long [ceil(seq_len / block_size)].
    sequence_block_ids: torch.Tensor | None = None


@dataclass
class CPUAttentionMetadata:
    """Everything a layer needs for one step; built once, read by every layer."""

    slot_mapping: torch.Tensor  # long [T]
    num_decodes: int
    decode_block_table: torch.Tensor | None  # long [num_decodes, max_blocks]
    # bool [num_decodes, 1, 1, max_blocks * block_size]; None for a lone decode, whose keys are
    # cut to its own length instead.
    decode_key_mask: torch.Tensor | None
    decode_num_keys: int  # keys each decode row attends over, padding included
    # A lone decode whose blocks are consecutive ids: its first block (read in place).
    decode_first_block: int | None
    prefills: list[PrefillSpan]
    # With native kernels: the decode rows' addressing for the native paged decode attention.
    paged_decodes: DecodeTables | None = None
    # Each decode row's length, long [num_decodes] (where a windowed layer masks on SDPA).
    decode_seq_lens: torch.Tensor | None = None


class CPUAttentionBackend:
    """Attention over the paged KV cache on a CPU: holds the native kernels (None: SDPA alone)
    and whether decode rows take the prefill kernel's arithmetic."""

    index_dtype = torch.long  # index_copy_ and the native KV write take int64 slots

    def __init__(
        self,
        device: torch.device,
        native_kernels: native.NativeKernels | None = None,
        decode_as_prefill: bool = False,
        flash_max_queries: int | None = FLASH_MAX_QUERIES_BESIDE_SDPA,
    ) -> None:
        self.device = device
        self.native = native_kernels
        self.decode_as_prefill = decode_as_prefill
        # Prefill spans longer than this go to SDPA unless decode rows take the prefill's
        # arithmetic (None: none do); measured at start where it matters (worker/flash_limit.py).
        self.flash_max_queries = flash_max_queries

    def build_metadata(self, layout: BatchLayout, slot_mapping: torch.Tensor) -> CPUAttentionMetadata:
        decodes = layout.sequences[: layout.num_decodes]
        # One table of the decode rows serves both the SDPA gather and the native kernels.
        decode_rows = (
            decode_tables(decodes, layout.block_size, slot_mapping[: layout.num_decodes]) if decodes else None
        )
        decode_block_table = decode_key_mask = None
        decode_num_keys = 0
        decode_first_block = None
        if len(decodes) == 1:
            decode_num_keys = decodes[0].seq_len
            lone_blocks = decodes[0].block_table[: ceil_div(decode_num_keys, layout.block_size)]
            decode_first_block = first_of_run(lone_blocks)
            if decode_first_block is None:
                decode_block_table = decode_rows.block_table
        elif decodes:
            decode_block_table = decode_rows.block_table
            decode_num_keys = decode_block_table.shape[1] * layout.block_size
            key_positions = torch.arange(decode_num_keys, device=self.device)
            decode_key_mask = (key_positions[None, :] < decode_rows.seq_lens[:, None])[:, None, None, :]
        prefills = []
        query_start = layout.num_decodes
        for sequence in layout.sequences[layout.num_decodes :]:
            context_first_block = sequence_first_block = sequence_block_ids = None
            if sequence.num_context_tokens:
                sequence_blocks = sequence.block_table[: ceil_div(sequence.seq_len, layout.block_size)]
                num_context_blocks = ceil_div(sequence.num_context_tokens, layout.block_size)
                context_first_block = first_of_run(sequence_blocks[:num_context_blocks])
                sequence_first_block = first_of_run(sequence_blocks)
                if sequence_first_block is None:
                    sequence_block_ids = torch.tensor(sequence_blocks, dtype=torch.long, device=self.device)
            prefills.append(
                PrefillSpan(
                    query_start,
                    sequence.query_len,
                    sequence.num_context_tokens,
                    context_first_block,
                    sequence_first_block,
                    sequence_block_ids,
                )
            )
            query_start += sequence.query_len
        return CPUAttentionMetadata(
            slot_mapping=slot_mapping,
            num_decodes=layout.num_decodes,
            decode_block_table=decode_block_table,
            decode_key_mask=decode_key_mask,
            decode_num_keys=decode_num_keys,
            decode_first_block=decode_first_block,
            prefills=prefills,
            paged_decodes=decode_rows if self.native is not None else None,
            decode_seq_lens=decode_rows.seq_lens if decode_rows is not None else None,
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: CPUAttentionMetadata,
        layer: LayerAttention = PLAIN_ATTENTION,
        sink_query: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self.native is not None and _native_writable(kv_cache, key, value, metadata.slot_mapping):
            self.native.attention.write_kv(kv_cache, key, value, metadata.slot_mapping)
        else:
            write_kv_reference(kv_cache, key, value, metadata.slot_mapping)
        if not metadata.prefills:  # a decode-only step: no output to assemble
            return self._decode(query, kv_cache, metadata, _FlashOptions(layer, sink_query))
        # Contiguous: each prefill span's kernel writes its rows in place.
        output = torch.empty(query.shape, dtype=query.dtype)
        if metadata.num_decodes:
            decodes = slice(0, metadata.num_decodes)
            output[decodes] = self._decode(
                query[decodes], kv_cache, metadata, _FlashOptions(layer, _rows_of(sink_query, decodes))
            )
        for span in metadata.prefills:
            rows = slice(span.query_start, span.query_start + span.query_len)
            options = _FlashOptions(layer, _rows_of(sink_query, rows))
            self._prefill(query[rows], key[rows], value[rows], kv_cache, span, options, output[rows])
        return output

    def _decode(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: CPUAttentionMetadata,
        options: _FlashOptions,
    ) -> torch.Tensor:
        """The AVX512-BF16 paged kernel where it applies (bf16, heads of 32 to 128), else the
        portable flash kernel (the prefill's arithmetic, always), else SDPA."""
        paged = metadata.paged_decodes
        layer = options.layer
        if paged is not None and self.native.attention.paged_decode_attention_supports(query, kv_cache):
            # Windows and caps only on the prefill's arithmetic (the exact kernel has neither).
            as_prefill = (self.decode_as_prefill or not layer.is_plain) and self.decodes_as_prefill(
                kv_cache.shape[2], query.dtype, query.shape[2]
            )
            if layer.is_plain or (as_prefill and _vector_bf16_attends(layer)):
                return self.native.attention.paged_decode_attention(
                    query,
                    kv_cache,
                    paged.block_table,
                    paged.seq_lens,
                    as_prefill=as_prefill,
                    window=layer.sliding_window or 0,
                    softcap=layer.logit_softcap or 0.0,
                )
        if (
            paged is not None
            and self.native.flash.flash_attention_supports(query, kv_cache)
            and kv_cache.is_contiguous()
        ):
            return self.native.flash.flash_decode_attention(
                query, kv_cache, paged.block_table, paged.seq_lens, **options.arguments()
            )
        if options.layer.logit_softcap is not None:
            return _softcapped_decode_attention(query, kv_cache, metadata, options.layer)
        return _decode_attention(query, kv_cache, metadata, options.layer.sliding_window)

    def decodes_as_prefill(self, block_size: int, dtype: torch.dtype, head_dim: int) -> bool:
        """Whether decode rows of this dtype and head size take the prefill kernel's arithmetic
        here: on the AVX512-BF16 kernels where they apply, else on the portable flash kernel
        (which also takes every row of a layer with sinks)."""
        if self.native is None:
            return False
        if _takes_vector_bf16_attention(self.native, dtype, head_dim):
            return (
                self.native.attention.has_prefill_attention
                and block_size % native_abi.DECODE_AS_PREFILL_BLOCK_MULTIPLE == 0
            )
        probe = torch.empty(1, 1, head_dim, dtype=dtype)
        return self.native.flash.flash_attention_supports(probe, probe)

    def _prefill(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        span: PrefillSpan,
        options: _FlashOptions,
        out: torch.Tensor,
    ) -> None:
        """Into `out` (contiguous, query's shape): the AVX512-BF16 kernel where it applies (bf16,
        heads of 32 to 128), else the portable flash kernel (for chunks of up to
        `flash_max_queries` queries unless decode rows take the prefill's arithmetic),
        else SDPA."""
        layer = options.layer
        if (
            self.native is not None
            and self.native.attention.has_prefill_attention
            and _vector_bf16_attends(layer)
        ):
            window = layer.sliding_window or 0
            keys_values = _keys_values_in_window(key, value, kv_cache, span, window)
            if self.native.attention.prefill_attention_supports(query, *keys_values):
                self.native.attention.prefill_attention(
                    query,
                    *keys_values,
                    torch.get_num_threads(),
                    window=window,
                    softcap=layer.logit_softcap or 0.0,
                    out=out,
                )
                return
        wants_flash = (
            self.decode_as_prefill
            or not options.layer.is_plain
            or self.flash_max_queries is None
            or span.query_len <= self.flash_max_queries
        )
        if (
            self.native is not None
            and wants_flash
            and _flash_takes(self.native, query, key, value, kv_cache, span)
        ):
            _flash_prefill(self.native, query, key, value, kv_cache, span, options, out)
        elif not options.layer.is_plain:
            out.copy_(_masked_prefill_attention(query, key, value, kv_cache, span, options.layer))
        else:
            out.copy_(_prefill_attention(query, key, value, kv_cache, span))


def _vector_bf16_attends(layer: LayerAttention) -> bool:
    """Whether the AVX512-BF16/AMX kernels attend as the layer does: causal, in a window or not,
    scores soft-capped or not (sinks are the portable kernel's)."""
    return not layer.sink_tokens


def _takes_vector_bf16_attention(kernels: native.NativeKernels, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the AVX512-BF16 kernels take decode rows and prefills of this dtype and head size."""
    probe = torch.empty(1, 1, head_dim, dtype=dtype)
    return kernels.attention.paged_decode_attention_supports(probe, probe.view(1, 1, 1, 1, head_dim))


def _flash_takes(
    kernels: native.NativeKernels,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    span: PrefillSpan,
) -> bool:
    if span.num_context_tokens:
        return kernels.flash.flash_attention_supports(query, kv_cache) and kv_cache.is_contiguous()
    return (
        kernels.flash.flash_attention_supports(query, key)
        and key.dtype == value.dtype
        and native_library.heads_contiguous(key)
        and native_library.heads_contiguous(value)
    )


def _flash_prefill(
    kernels: native.NativeKernels,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    span: PrefillSpan,
    options: _FlashOptions,
    out: torch.Tensor,
) -> None:
    """Into `out`: a fresh prompt over its own K/V; a chunk over its context and new tokens,
    already in the cache: a view of a run of blocks, or its scattered blocks read in place (no
    gather)."""
    threads = torch.get_num_threads()
    arguments = options.arguments()
    if not span.num_context_tokens:
        kernels.flash.flash_attention(query, key, value, threads, **arguments, out=out)
        return
    num_keys = span.num_context_tokens + span.query_len
    if span.sequence_first_block is not None:
        keys_values = context_in_place(kv_cache, span.sequence_first_block, num_keys)
        kernels.flash.flash_attention(query, *keys_values, threads, **arguments, out=out)
        return
    kernels.flash.flash_attention_paged(
        query, kv_cache, span.sequence_block_ids, num_keys, threads, **arguments, out=out
    )


@dataclass(frozen=True)
class _FlashOptions:
    """How a call's rows attend on the flash kernels: the layer's variant and, with sinks, the
    rows' sink queries."""

    layer: LayerAttention
    sink_query: torch.Tensor | None

    def arguments(self) -> dict[str, Any]:
        """The flash kernels' window, softcap and sink arguments (0: none)."""
        return {
            "window": self.layer.sliding_window or 0,
            "softcap": self.layer.logit_softcap or 0.0,
            "sink_tokens": self.layer.sink_tokens,
            "sink_query": self.sink_query,
        }


def _rows_of(tensor: torch.Tensor | None, rows: slice) -> torch.Tensor | None:
    return tensor[rows] if tensor is not None else None


def _native_writable(
    kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> bool:
    """The native copy takes rows of contiguous heads into a contiguous cache."""
    return (
        native_library.supports(key)
        and kv_cache.dtype == key.dtype == value.dtype
        and kv_cache.is_contiguous()
        and native_library.heads_contiguous(key)
        and native_library.heads_contiguous(value)
        and slot_mapping.dtype == torch.long
        and slot_mapping.is_contiguous()
        and slot_mapping.shape[0] == key.shape[0]
    )


def _keys_values_in_window(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, span: PrefillSpan, window: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of a chunk on cached context from the prefill kernel's key block holding its first
    query's window on (all of them without a window): those before it are never read (their
    blocks may be back in the pool), and from a multiple of the key block the kernel meets the
    keys in the blocks it would meet them in from key 0, so the rows keep their bits."""
    first_needed = max(0, span.num_context_tokens - window + 1) if window else 0
    first_key = first_needed // native_abi.PREFILL_KEY_BLOCK * native_abi.PREFILL_KEY_BLOCK
    if not span.num_context_tokens or first_key == 0:
        return _all_keys_values(key, value, kv_cache, span)
    num_keys = span.num_context_tokens + span.query_len
    if span.sequence_first_block is None:
        return gather_context(kv_cache, span.sequence_block_ids, num_keys, first_key)
    keys, values = context_in_place(kv_cache, span.sequence_first_block, num_keys)
    return keys[first_key:], values[first_key:]


def _all_keys_values(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, span: PrefillSpan
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of every position the span attends to, as one tensor each: the fresh ones
    alone, or (already written) the cache's run of blocks, or one gather of its scattered
    blocks (a copy per layer, far cheaper than attending to context and new keys apart)."""
    if not span.num_context_tokens:
        return key, value
    num_keys = span.num_context_tokens + span.query_len
    if span.sequence_first_block is None:
        return gather_context(kv_cache, span.sequence_block_ids, num_keys)
    return context_in_place(kv_cache, span.sequence_first_block, num_keys)


def first_of_run(block_ids: list[int]) -> int | None:
    """The first id when `block_ids` are consecutive ascending ids, else None."""
    first = block_ids[0]
    if block_ids[-1] - first != len(block_ids) - 1 or block_ids != list(range(first, first + len(block_ids))):
        return None
    return first


def context_in_place(
    kv_cache: torch.Tensor, first_block: int, num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [num_tokens, num_kv_heads, head_dim]: views of a run of blocks starting at `first_block`."""
    num_kv_heads, head_dim = kv_cache.shape[-2], kv_cache.shape[-1]
    start = first_block * kv_cache.shape[2]
    keys = kv_cache[0].view(-1, num_kv_heads, head_dim)[start : start + num_tokens]
    values = kv_cache[1].view(-1, num_kv_heads, head_dim)[start : start + num_tokens]
    return keys, values


def gather_context(
    kv_cache: torch.Tensor, block_ids: torch.Tensor, num_tokens: int, first_token: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [num_tokens - first_token, num_kv_heads, head_dim] of one sequence's tokens
    first_token .. num_tokens - 1 (the blocks before first_token's never read)."""
    num_kv_heads, head_dim = kv_cache.shape[-2], kv_cache.shape[-1]
    first_block, skipped = divmod(first_token, kv_cache.shape[2])
    block_ids = block_ids[first_block:]
    end = num_tokens - first_block * kv_cache.shape[2]
    keys = kv_cache[0].index_select(0, block_ids).view(-1, num_kv_heads, head_dim)[skipped:end]
    values = kv_cache[1].index_select(0, block_ids).view(-1, num_kv_heads, head_dim)[skipped:end]
    return keys, values


def _decode_attention(
    query: torch.Tensor, kv_cache: torch.Tensor, metadata: CPUAttentionMetadata, window: int | None
) -> torch.Tensor:
    num_decodes, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[-2]
    group = num_heads // num_kv_heads
    keys, values = _gather_decode_context(kv_cache, metadata)
    key_mask = metadata.decode_key_mask
    if window is not None:
        if key_mask is None:  # a lone decode, its keys cut to its length: keep the last `window`
            keys, values = keys[:, :, -window:], values[:, :, -window:]
        else:
            key_positions = torch.arange(keys.shape[2], device=keys.device)
            window_starts = metadata.decode_seq_lens - window
            key_mask = key_mask & (key_positions[None, :] >= window_starts[:, None])[:, None, None, :]
    # One new token per sequence, so the query heads sharing a KV head fold into its rows.
    grouped_query = query.view(num_decodes, num_kv_heads, group, head_dim)
    output = F.scaled_dot_product_attention(grouped_query, keys, values, attn_mask=key_mask)
    return output.reshape(num_decodes, num_heads, head_dim)


def _gather_decode_context(
    kv_cache: torch.Tensor, metadata: CPUAttentionMetadata
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [num_decodes, kv_heads, decode_num_keys, D] through the decode block tables.

    index_select over whole blocks is a copy per block; indexing with the 2-D table instead
    costs three times as much, and the gather runs in every layer of every decode step.
    """
    if metadata.decode_first_block is not None:
        keys, values = context_in_place(kv_cache, metadata.decode_first_block, metadata.decode_num_keys)
        return keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0)
    table = metadata.decode_block_table
    num_decodes = table.shape[0]
    num_kv_heads, head_dim = kv_cache.shape[-2], kv_cache.shape[-1]
    flat_table = table.view(-1)
    keys = kv_cache[0].index_select(0, flat_table).view(num_decodes, -1, num_kv_heads, head_dim)
    values = kv_cache[1].index_select(0, flat_table).view(num_decodes, -1, num_kv_heads, head_dim)
    num_keys = metadata.decode_num_keys
    return keys[:, :num_keys].transpose(1, 2), values[:, :num_keys].transpose(1, 2)


def _prefill_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, span: PrefillSpan
) -> torch.Tensor:
    if not span.num_context_tokens:
        return causal_self_attention(query, key, value)
    # [n, heads, D] -> [1, heads, n, D]
    query_t = query.transpose(0, 1).unsqueeze(0)
    key_t = key.transpose(0, 1).unsqueeze(0)
    value_t = value.transpose(0, 1).unsqueeze(0)
    if span.context_first_block is not None:
        context_keys, context_values = context_in_place(
            kv_cache, span.context_first_block, span.num_context_tokens
        )
    else:
        num_context_blocks = ceil_div(span.num_context_tokens, kv_cache.shape[2])
        context_block_ids = span.sequence_block_ids[:num_context_blocks]
        context_keys, context_values = gather_context(kv_cache, context_block_ids, span.num_context_tokens)
    context_output, context_lse = _flash_with_lse(
        query_t,
        context_keys.transpose(0, 1).unsqueeze(0),
        context_values.transpose(0, 1).unsqueeze(0),
        causal=False,
    )
    new_output, new_lse = _flash_with_lse(query_t, key_t, value_t, causal=True)
    merged = merge_attention_states(context_output, context_lse, new_output, new_lse)
    return merged.squeeze(0).transpose(0, 1)


def _masked_prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    span: PrefillSpan,
    layer: LayerAttention,
) -> torch.Tensor:
    """Every key of the span with a mask: causal and, with a window, query i (position p) sees
    keys p - window + 1 .. p (keys the window has left may sit in freed blocks: masked, never
    weighed). SDPA, or plain math where scores are soft-capped (SDPA cannot)."""
    keys, values = _all_keys_values(key, value, kv_cache, span)
    query_positions = torch.arange(span.num_context_tokens, span.num_context_tokens + span.query_len)
    offsets = query_positions[:, None] - torch.arange(keys.shape[0])[None, :]
    allowed = offsets >= 0
    if layer.sliding_window is not None:
        allowed &= offsets < layer.sliding_window
    query_t = query.transpose(0, 1).unsqueeze(0)  # [1, heads, n, D]
    keys_t, values_t = keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0)
    allowed = allowed.to(query.device)
    if layer.logit_softcap is None:
        output = F.scaled_dot_product_attention(query_t, keys_t, values_t, attn_mask=allowed, enable_gqa=True)
    else:
        group = query.shape[1] // keys.shape[1]
        keys_t, values_t = keys_t.repeat_interleave(group, 1), values_t.repeat_interleave(group, 1)
        output = _softcapped_attention(query_t, keys_t, values_t, allowed, layer.logit_softcap)
    return output.squeeze(0).transpose(0, 1)


def _softcapped_decode_attention(
    query: torch.Tensor, kv_cache: torch.Tensor, metadata: CPUAttentionMetadata, layer: LayerAttention
) -> torch.Tensor:
    """Decode rows over their gathered contexts in plain math, scores soft-capped."""
    num_decodes, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[-2]
    keys, values = _gather_decode_context(kv_cache, metadata)  # [N, kv_heads, keys, D]
    key_positions = torch.arange(keys.shape[2], device=keys.device)
    seq_lens = metadata.decode_seq_lens[:, None]
    allowed = key_positions[None, :] < seq_lens
    if layer.sliding_window is not None:
        allowed &= key_positions[None, :] >= seq_lens - layer.sliding_window
    grouped_query = query.view(num_decodes, num_kv_heads, num_heads // num_kv_heads, head_dim)
    output = _softcapped_attention(
        grouped_query, keys, values, allowed[:, None, None, :], layer.logit_softcap
    )
    return output.reshape(num_decodes, num_heads, head_dim)


def _softcapped_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor, softcap: float
) -> torch.Tensor:
    """softmax(cap * tanh(q k^T / sqrt(D) / cap), masked) v in float32: query [..., n, D], keys and
    values [..., m, D], `allowed` broadcasting to [..., n, m]."""
    scores = query.float() @ keys.float().transpose(-1, -2) * query.shape[-1] ** -0.5
    scores = torch.tanh(scores / softcap) * softcap
    weights = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
    return (weights @ values.float()).to(query.dtype)


def _flash_with_lse(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """[1, heads, n, D] output and its [1, heads, n] log-sum-exp of the scaled scores."""
    output, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, causal)
    return output, lse


def merge_attention_states(
    output_a: torch.Tensor, lse_a: torch.Tensor, output_b: torch.Tensor, lse_b: torch.Tensor
) -> torch.Tensor:
    """Softmax over the union of two key sets, from each set's normalized output and LSE."""
    lse_max = torch.maximum(lse_a, lse_b)
    weight_a = torch.exp(lse_a - lse_max).unsqueeze(-1)
    weight_b = torch.exp(lse_b - lse_max).unsqueeze(-1)
    merged = (output_a.float() * weight_a + output_b.float() * weight_b) / (weight_a + weight_b)
    return merged.to(output_a.dtype)
