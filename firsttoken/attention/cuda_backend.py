"""Paged attention on a CUDA device.

- This step's K/V are written to the cache first, by one Triton kernel over the slot mapping.
- Prefills with no cached context attend to their own fresh K/V through PyTorch's SDPA,
  which runs its FlashAttention kernel for 16-bit inputs (causal, GQA without copying K/V),
  unless the backend is built with `paged_prefills`: then they too read their keys from the
  cache through the Triton kernel. One kernel for every row gives a step fixed launch shapes
  (what a captured graph needs) and a row the same arithmetic whatever shares its step.
- Decodes and prefill chunks on cached context (a prefix-cache hit, an earlier chunk) read
  every key from the cache through their block tables: the Triton paged kernel. With
  `decodes_as_chunks` a decode runs as a one-token tile of the chunk kernel's shape, so it
  gets the bits the same token gets as a prefill row (a request recomputed after preemption
  prefills the tokens it had decoded). With both options a row's attention is the same bits
  whatever else shares its step: one-shot, chunked, prefix-cached or decoded.
- Sliding windows, soft-capped scores and StreamingLLM sinks are the paged kernel's: a model
  with such layers pages every prefill.

Metadata is built once per step: its integer tables are packed on the host and reach the
device in one non-blocking copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from firsttoken.attention.backend import (
    PLAIN_ATTENTION,
    BatchLayout,
    LayerAttention,
    SequenceLayout,
    block_table_array,
)
from firsttoken.attention.triton_kernels import (
    TILE_FIELDS,
    ChunkQueries,
    DecodeQueries,
    chunk_tiles,
    paged_chunk_attention,
    paged_decode_attention,
    prefill_tile_shape,
    store_kv,
)
from firsttoken.attention.sdpa import causal_self_attention
from firsttoken.attention.staging import StagingBuffer


@dataclass(frozen=True)
class FreshPrefill:
    """A prefill with no cached context: rows [first_row, first_row + num_tokens) of the batch."""

    first_row: int
    num_tokens: int


@dataclass(frozen=True)
class CudaAttentionMetadata:
    """Everything a layer needs for one step; built once, read by every layer."""

    slot_mapping: torch.Tensor  # [T]
    decodes: DecodeQueries | None  # rows [0, num_decodes)
    chunks: ChunkQueries | None  # prefills on cached context
    fresh_prefills: list[FreshPrefill]
    # Rows no query covers (a graph's padding tokens): their output is zeroed, so padding rows
    # carry finite values through the layers instead of whatever the memory held.
    has_uncovered_rows: bool = False


class CudaAttentionBackend:
    """SDPA flash for fresh prefills (unless `paged_prefills`), Triton for everything read
    from the paged cache (decodes on the chunk kernel's tiles when `decodes_as_chunks`).

    Owns the staging buffer its per-step tables travel through.
    """

    index_dtype = torch.int32  # what the Triton kernels read

    def __init__(
        self,
        device: torch.device,
        num_heads: int,
        num_kv_heads: int,
        paged_prefills: bool = False,
        decodes_as_chunks: bool = False,
    ) -> None:
        self.device = device
        self.paged_prefills = paged_prefills
        self.decodes_as_chunks = decodes_as_chunks
        self.chunk_tile_tokens = prefill_tile_shape(num_heads // num_kv_heads).query_tokens
        self.staging = StagingBuffer(device, torch.int32)

    @property
    def rows_invariant(self) -> bool:
        """Whether a row's attention is the same bits whatever shares its step: every row on
        the chunk kernel's tiles, fresh prefills and decodes included."""
        return self.paged_prefills and self.decodes_as_chunks

    def build_metadata(self, layout: BatchLayout, slot_mapping: torch.Tensor) -> CudaAttentionMetadata:
        decodes = layout.sequences[: layout.num_decodes]
        chunks: list[SequenceLayout] = []
        chunk_rows: list[tuple[int, int, int]] = []
        fresh_prefills = []
        prefill_rows = layout.query_rows()[layout.num_decodes :]
        for sequence, rows in zip(layout.sequences[layout.num_decodes :], prefill_rows):
            if sequence.num_context_tokens or self.paged_prefills:
                chunks.append(sequence)
                chunk_rows.append(rows)
            else:
                fresh_prefills.append(FreshPrefill(rows[0], sequence.query_len))
        arrays = []
        if decodes:
            seq_lens = np.array([sequence.seq_len for sequence in decodes], dtype=np.int32)
            arrays += [block_table_array(decodes, layout.block_size), seq_lens]
        if chunks:
            arrays += [
                block_table_array(chunks, layout.block_size),
                chunk_tile_array(chunk_rows, self.chunk_tile_tokens),
            ]
        staged = iter(self.staging.stage(arrays))
        return CudaAttentionMetadata(
            slot_mapping=slot_mapping,
            decodes=DecodeQueries(next(staged), next(staged)) if decodes else None,
            chunks=ChunkQueries(next(staged), next(staged)) if chunks else None,
            fresh_prefills=fresh_prefills,
        )

    @staticmethod
    def decode_metadata(
        slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor
    ) -> CudaAttentionMetadata:
        """Metadata of a decode-only step over tensors the caller owns (a graph's static inputs)."""
        return CudaAttentionMetadata(slot_mapping, DecodeQueries(block_tables, seq_lens), None, [])

    @staticmethod
    def chunk_metadata(
        slot_mapping: torch.Tensor, block_tables: torch.Tensor, tiles: torch.Tensor
    ) -> CudaAttentionMetadata:
        """Metadata of a step whose every row attends through the chunk kernel's `tiles`, over
        tensors the caller owns (a graph's static inputs)."""
        return CudaAttentionMetadata(
            slot_mapping, None, ChunkQueries(block_tables, tiles), [], has_uncovered_rows=True
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: CudaAttentionMetadata,
        layer: LayerAttention = PLAIN_ATTENTION,
        sink_query: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Each row over its earlier keys as `layer` attends. A layer other than plain causal
        attention (window, soft-cap, sinks) has no SDPA form: a backend serving such layers is
        built with `paged_prefills`, so no fresh prefill reaches SDPA."""
        if metadata.fresh_prefills and not layer.is_plain:
            raise ValueError(
                "layer: windows, soft-caps and sinks run on the paged kernel; "
                "build the backend with paged_prefills"
            )
        store_kv(kv_cache, key, value, metadata.slot_mapping)
        output = torch.zeros_like(query) if metadata.has_uncovered_rows else torch.empty_like(query)
        if metadata.decodes is not None:
            # Captured decode graphs run this too: their decodes take the same tiles.
            paged_decode_attention(
                output, query, kv_cache, metadata.decodes, self.decodes_as_chunks, layer, sink_query
            )
        if metadata.chunks is not None:
            paged_chunk_attention(output, query, kv_cache, metadata.chunks, layer, sink_query)
        for prefill in metadata.fresh_prefills:
            rows = slice(prefill.first_row, prefill.first_row + prefill.num_tokens)
            output[rows] = causal_self_attention(query[rows], key[rows], value[rows])
        return output


def chunk_tile_array(query_rows: list[tuple[int, int, int]], tile_tokens: int) -> np.ndarray:
    """int32 [num_tiles, TILE_FIELDS]: the chunk kernel's tiles of the sequences whose
    (first query row, context length, query length) are `query_rows`."""
    return np.array(chunk_tiles(query_rows, tile_tokens), dtype=np.int32).reshape(-1, TILE_FIELDS)
