"""Triton kernels of the CUDA attention path; their plain-PyTorch references are in `reference`.

- `store_kv` (reference: `attention.reference.write_kv_reference`): one kernel writes a
  step's K and V at their slots (block_id * block_size + offset).
- `paged_decode_attention` and `paged_chunk_attention` (reference:
  `attention.reference.paged_attention_reference`): queries attend causally to their
  sequence's keys, read from the paged cache through its block table. One kernel serves both:
  decodes (one query token per sequence) and prefill chunks on top of cached context (a prefix
  hit, earlier chunks) read every key from the cache once this step's K/V are written. The
  query heads sharing a KV head are folded into the rows of one tile, so each K/V tile is
  loaded once per KV head (GQA). A layer's sliding window, soft-capped scores (Gemma 2) and
  StreamingLLM sinks are specializations of the same kernel: a plain layer's binary has none
  of their arithmetic.

Both run under `TRITON_INTERPRET=1` on CPU tensors, which is how CI tests them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from firsttoken.attention.backend import PLAIN_ATTENTION, LayerAttention

# Rows of a prefill tile (query tokens x query heads of one KV head) and keys per tile.
PREFILL_TILE_ROWS = 64
KEYS_PER_TILE = 64
_MIN_DOT_SIZE = 16  # tl.dot needs every dimension >= 16
_LOG2_E = 1.4426950408889634


@dataclass(frozen=True)
class TileShape:
    """How many query tokens one program handles, and its row count once heads are folded in."""

    query_tokens: int
    rows: int


def decode_tile_shape(group: int) -> TileShape:
    """One query token per program; its `group` heads padded to a power of two >= 16 rows."""
    return TileShape(1, max(_MIN_DOT_SIZE, triton.next_power_of_2(group)))


def prefill_tile_shape(group: int) -> TileShape:
    """As many query tokens as keep the folded rows near PREFILL_TILE_ROWS."""
    query_tokens = max(1, PREFILL_TILE_ROWS // group)
    return TileShape(query_tokens, max(_MIN_DOT_SIZE, triton.next_power_of_2(query_tokens * group)))


# -- KV write -------------------------------------------------------------------------------


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    cache_ptr,
    slot_mapping_ptr,
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    stride_cache_kv,
    stride_cache_slot,
    stride_cache_head,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    mask = (heads < NUM_KV_HEADS)[:, None] & (dims < HEAD_DIM)[None, :]
    key = tl.load(
        key_ptr + token * stride_key_token + heads[:, None] * stride_key_head + dims[None, :], mask=mask
    )
    value = tl.load(
        value_ptr + token * stride_value_token + heads[:, None] * stride_value_head + dims[None, :], mask=mask
    )
    destination = cache_ptr + slot * stride_cache_slot + heads[:, None] * stride_cache_head + dims[None, :]
    tl.store(destination, key, mask=mask)
    tl.store(destination + stride_cache_kv, value, mask=mask)


def store_kv(
    kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write K and V [T, kv_heads, D] at `slot_mapping` [T] in one launch."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _check_cache(kv_cache)
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        kv_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(2),
        kv_cache.stride(3),
        NUM_KV_HEADS=num_kv_heads,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
    )


# -- paged attention ------------------------------------------------------------------------

TILE_FIELDS = 4  # a chunk tile's (sequence, first query row, first query position, query rows)


@dataclass(frozen=True)
class DecodeQueries:
    """Decodes: query row i is the newest token of sequence i, at position seq_lens[i] - 1."""

    block_tables: torch.Tensor  # int32 [S, max_blocks]
    seq_lens: torch.Tensor  # int32 [S]: cached context plus this step's token


@dataclass(frozen=True)
class ChunkQueries:
    """Prefill chunks on cached context, cut into tiles of `prefill_tile_shape(group).query_tokens`."""

    block_tables: torch.Tensor  # int32 [S, max_blocks]
    tiles: torch.Tensor  # int32 [num_tiles, TILE_FIELDS]


def chunk_tiles(chunks: list[tuple[int, int, int]], tile_tokens: int) -> list[tuple[int, int, int, int]]:
    """Tiles of chunks given as (first query row, context length, query length), in order.

    Each tile is (chunk index, first query row, position of that row, rows in the tile).
    """
    tiles = []
    for chunk_index, (first_row, context_len, query_len) in enumerate(chunks):
        for start in range(0, query_len, tile_tokens):
            tiles.append(
                (chunk_index, first_row + start, context_len + start, min(tile_tokens, query_len - start))
            )
    return tiles


@triton.jit
def _window_start(position, window, WINDOWED: tl.constexpr, SINK_TOKENS: tl.constexpr):
    """The first key a query at `position` sees: its window's start, or 0 without a window or
    while the window still reaches past the sinks (every key up to the query, then)."""
    if WINDOWED:
        start = tl.maximum(position - window + 1, 0)
        return tl.where(start <= SINK_TOKENS, 0, start)
    else:
        return position * 0


@triton.jit
def _attend_key_block(
    query,
    cache_ptr,
    table_row,
    key_positions,
    loaded,  # [KEYS]: the keys read from the cache
    visible,  # [ROWS, KEYS]: the keys each row sees
    running_max,
    running_sum,
    accumulator,
    kv_head,
    dims,
    dim_valid,
    scale_log2,
    softcap_exp2_scale,
    softcap_log2,
    stride_cache_kv,
    stride_cache_block,
    stride_cache_offset,
    stride_cache_head,
    BLOCK_SIZE: tl.constexpr,
    SOFTCAPPED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One block of keys folded into the rows' online softmax: their new max, sum and output."""
    block_ids = tl.load(table_row + key_positions // BLOCK_SIZE, mask=loaded, other=0).to(tl.int64)
    slot_offsets = (
        block_ids * stride_cache_block
        + (key_positions % BLOCK_SIZE).to(tl.int64) * stride_cache_offset
        + kv_head * stride_cache_head
    )
    kv_mask = loaded[:, None] & dim_valid[None, :]
    keys = tl.load(cache_ptr + slot_offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0)
    products = tl.dot(query, tl.trans(keys), input_precision=DOT_PRECISION)
    if SOFTCAPPED:
        # cap * tanh(s / cap) in base 2, tanh from exp2 (no tanh in triton.language): saturates
        # to +-1 without NaN at either end.
        scores = softcap_log2 * (1.0 - 2.0 / (tl.exp2(products * softcap_exp2_scale) + 1.0))
    else:
        scores = products * scale_log2
    scores = tl.where(visible, scores, float("-inf"))
    new_max = tl.maximum(running_max, tl.max(scores, axis=1))
    rescale = tl.exp2(running_max - new_max)
    probabilities = tl.exp2(scores - new_max[:, None])
    running_sum = running_sum * rescale + tl.sum(probabilities, axis=1)
    values = tl.load(
        cache_ptr + stride_cache_kv + slot_offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0
    )
    accumulator = accumulator * rescale[:, None] + tl.dot(
        probabilities.to(values.dtype), values, input_precision=DOT_PRECISION
    )
    return new_max, running_sum, accumulator


# What differs between a decode launch and a chunk launch of the same tile shape is data (the
# decode flag, the tables' addresses and row stride), never a specialization: both run one binary.
@triton.jit(
    do_not_specialize=["one_token_per_seq", "stride_table_seq"],
    do_not_specialize_on_alignment=["block_tables_ptr", "queries_ptr"],
)
def _paged_attention_kernel(
    output_ptr,
    query_ptr,
    sink_query_ptr,  # laid out as query; read with SINK_TOKENS only
    cache_ptr,
    block_tables_ptr,
    queries_ptr,  # decodes: seq_lens [S]; chunks: tiles [num_tiles, TILE_FIELDS]
    one_token_per_seq,  # 1: decodes, 0: chunks
    scale_log2,
    window,  # with WINDOWED: a query at position p sees keys p - window + 1 .. p
    softcap_exp2_scale,  # with SOFTCAPPED: 2 log2(e) scale / cap (tanh's exp2 argument per product)
    softcap_log2,  # with SOFTCAPPED: the cap times log2(e)
    stride_query_token,
    stride_query_head,
    stride_sink_query_token,
    stride_sink_query_head,
    stride_output_token,
    stride_output_head,
    stride_cache_kv,
    stride_cache_block,
    stride_cache_offset,
    stride_cache_head,
    stride_table_seq,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    TILE_TOKENS: tl.constexpr,
    TILE_ROWS: tl.constexpr,
    KEYS_PER_TILE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    WINDOWED: tl.constexpr,
    SOFTCAPPED: tl.constexpr,
    SINK_TOKENS: tl.constexpr,  # StreamingLLM's sinks (<= KEYS_PER_TILE, WINDOWED), or 0
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    if one_token_per_seq:
        seq = tile
        first_row = tile
        first_position = tl.load(queries_ptr + tile) - 1
        num_rows = 1
    else:
        fields = queries_ptr + tile * 4  # TILE_FIELDS
        seq = tl.load(fields)
        first_row = tl.load(fields + 1)
        first_position = tl.load(fields + 2)
        num_rows = tl.load(fields + 3)

    # Row r of the tile is query token r // GROUP under query head kv_head * GROUP + r % GROUP.
    rows = tl.arange(0, TILE_ROWS)
    token_in_tile = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_valid = (token_in_tile < TILE_TOKENS) & (token_in_tile < num_rows)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < HEAD_DIM
    token_rows = (first_row + token_in_tile).to(tl.int64)
    query = tl.load(
        query_ptr
        + token_rows[:, None] * stride_query_token
        + head[:, None] * stride_query_head
        + dims[None, :],
        mask=row_valid[:, None] & dim_valid[None, :],
        other=0.0,
    )
    query_positions = first_position + token_in_tile
    # The tile's last query token sees keys up to its own position.
    num_keys = first_position + num_rows
    # Each row's first key: its window's start (0 while the window still reaches the sinks).
    first_keys = _window_start(query_positions, window, WINDOWED, SINK_TOKENS)
    # Keys before the first row's window are never loaded: their blocks may have been freed.
    first_loaded = _window_start(first_position, window, WINDOWED, SINK_TOKENS)

    # Online softmax in base 2. A finite start for the running max keeps rows that see no key
    # in a tile (padding rows, causal edges) free of inf - inf.
    #
    # A row's result depends on its own query and keys only, never on the other rows of its
    # tile (other tokens of its chunk, padding, or none: a decode as a one-token tile), so one
    # token gets the same bits alone, in any chunk, at any place in a tile, and as a decode:
    # - key blocks start at 0 and step by KEYS_PER_TILE whatever the tile: a row always meets
    #   its keys in the same blocks, in the same order (the sinks first, in a block of their own);
    # - every product of a tl.dot output row is that row of the query times the keys (or of the
    #   probabilities times the values), summed over the same K as every other row;
    # - what the tile's other rows add for this row is exact no-ops: a key past this row's
    #   position or before its window (loaded for another row, or masked to 0) scores -inf,
    #   so it leaves the block's max as it is, adds exp2(-inf) = 0 to the sum and a zero
    #   product to the accumulator; a block holding no key this row sees (the tile's last
    #   rows see more keys, its first rows' windows start earlier) rescales by exp2(0) = 1
    #   and adds zeros. Blocks wholly before the first row's window are skipped for the same
    #   reason: every row would add exact no-ops there.
    running_max = tl.full([TILE_ROWS], -1.0e30, dtype=tl.float32)
    running_sum = tl.zeros([TILE_ROWS], dtype=tl.float32)
    accumulator = tl.zeros([TILE_ROWS, HEAD_DIM_PAD], dtype=tl.float32)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_table_seq
    key_offsets = tl.arange(0, KEYS_PER_TILE)
    if SINK_TOKENS > 0:
        # A row whose window has left the sinks sees them too, scored with its sink query.
        sink_query = tl.load(
            sink_query_ptr
            + token_rows[:, None] * stride_sink_query_token
            + head[:, None] * stride_sink_query_head
            + dims[None, :],
            mask=row_valid[:, None] & dim_valid[None, :],
            other=0.0,
        )
        sink_valid = key_offsets < SINK_TOKENS
        running_max, running_sum, accumulator = _attend_key_block(
            sink_query, cache_ptr, table_row, key_offsets, sink_valid,
            sink_valid[None, :] & (first_keys > 0)[:, None],
            running_max, running_sum, accumulator, kv_head, dims, dim_valid, scale_log2,
            softcap_exp2_scale, softcap_log2, stride_cache_kv, stride_cache_block, stride_cache_offset,
            stride_cache_head, BLOCK_SIZE, SOFTCAPPED, DOT_PRECISION,
        )  # fmt: skip
    for key_start in range(first_loaded // KEYS_PER_TILE * KEYS_PER_TILE, num_keys, KEYS_PER_TILE):
        key_positions = key_start + key_offsets
        loaded = (key_positions < num_keys) & (key_positions >= first_loaded)
        visible = (
            loaded[None, :]
            & (key_positions[None, :] <= query_positions[:, None])
            & (key_positions[None, :] >= first_keys[:, None])
        )
        running_max, running_sum, accumulator = _attend_key_block(
            query, cache_ptr, table_row, key_positions, loaded, visible,
            running_max, running_sum, accumulator, kv_head, dims, dim_valid, scale_log2,
            softcap_exp2_scale, softcap_log2, stride_cache_kv, stride_cache_block, stride_cache_offset,
            stride_cache_head, BLOCK_SIZE, SOFTCAPPED, DOT_PRECISION,
        )  # fmt: skip

    output = accumulator / tl.where(running_sum > 0, running_sum, 1.0)[:, None]
    tl.store(
        output_ptr
        + token_rows[:, None] * stride_output_token
        + head[:, None] * stride_output_head
        + dims[None, :],
        output.to(output_ptr.dtype.element_ty),
        mask=row_valid[:, None] & dim_valid[None, :],
    )


def paged_decode_attention(
    output: torch.Tensor,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    decodes: DecodeQueries,
    as_chunk_tiles: bool = False,
    layer: LayerAttention = PLAIN_ATTENTION,
    sink_query: torch.Tensor | None = None,
) -> None:
    """Rows [0, S) of `output` [T, heads, D]: each decode's query over its context (as `layer`
    attends: window, soft-cap, sinks scored with `sink_query`).

    `as_chunk_tiles`: each decode is a one-token tile of the chunk kernel's shape, the binary
    `paged_chunk_attention` runs, so a decode row gets the bits the same token gets as a row
    of a prefill chunk (see `_paged_attention_kernel`'s note on rows); else a tile of just the
    decode's heads (16 rows rather than 64 for small groups)."""
    num_seqs = decodes.seq_lens.shape[0]
    group = query.shape[1] // kv_cache.shape[3]
    tile = prefill_tile_shape(group) if as_chunk_tiles else decode_tile_shape(group)
    block_tables, seq_lens = decodes.block_tables, decodes.seq_lens
    _launch(output, query, kv_cache, block_tables, seq_lens, num_seqs, tile, True, layer, sink_query)


def paged_chunk_attention(
    output: torch.Tensor,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    chunks: ChunkQueries,
    layer: LayerAttention = PLAIN_ATTENTION,
    sink_query: torch.Tensor | None = None,
) -> None:
    """The rows of every chunk tile: causal attention over cached context and the chunk itself,
    as `layer` attends."""
    group = query.shape[1] // kv_cache.shape[3]
    tiles = chunks.tiles
    _launch(
        output,
        query,
        kv_cache,
        chunks.block_tables,
        tiles,
        tiles.shape[0],
        prefill_tile_shape(group),
        False,
        layer,
        sink_query,
    )


def check_layer_attention(layer: LayerAttention) -> None:
    """Refuse what the paged kernel cannot attend: sinks beyond one key block, or without a window."""
    if layer.sink_tokens and (layer.sliding_window is None or layer.sink_tokens > KEYS_PER_TILE):
        raise ValueError(
            f"sink_tokens: the Triton kernel takes 1..{KEYS_PER_TILE} sinks beside a window, "
            f"not {layer.sink_tokens} (window {layer.sliding_window})"
        )


def _launch(
    output: torch.Tensor,  # [T, num_heads, head_dim]
    query: torch.Tensor,  # [T, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim], this step's K/V written
    block_tables: torch.Tensor,
    queries: torch.Tensor,
    num_programs: int,
    tile: TileShape,
    one_token_per_seq: bool,
    layer: LayerAttention,
    sink_query: torch.Tensor | None,
) -> None:
    if num_programs == 0:
        return
    _check_cache(kv_cache)
    check_layer_attention(layer)
    if layer.sink_tokens and (sink_query is None or sink_query.shape != query.shape):
        raise ValueError("sink_query: a layer with sinks needs one, shaped as the query")
    sink_query = sink_query if layer.sink_tokens else query
    if query.stride(-1) != 1 or output.stride(-1) != 1 or sink_query.stride(-1) != 1:
        raise ValueError("query, sink_query, output: the head dimension must be contiguous")
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    scale = head_dim**-0.5
    softcap = layer.logit_softcap or 1.0
    _paged_attention_kernel[(num_programs, num_kv_heads)](
        output,
        query,
        sink_query,
        kv_cache,
        block_tables,
        queries,
        int(one_token_per_seq),
        _LOG2_E * scale,
        layer.sliding_window or 0,
        2 * _LOG2_E * scale / softcap,
        _LOG2_E * softcap,
        query.stride(0),
        query.stride(1),
        sink_query.stride(0),
        sink_query.stride(1),
        output.stride(0),
        output.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        block_tables.stride(0),
        BLOCK_SIZE=block_size,
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=max(_MIN_DOT_SIZE, triton.next_power_of_2(head_dim)),
        TILE_TOKENS=tile.query_tokens,
        TILE_ROWS=tile.rows,
        KEYS_PER_TILE=KEYS_PER_TILE,
        # float32 stays exact; 16-bit inputs use the tensor cores' native precision.
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        WINDOWED=layer.sliding_window is not None,
        SOFTCAPPED=layer.logit_softcap is not None,
        SINK_TOKENS=layer.sink_tokens,
    )


def _check_cache(kv_cache: torch.Tensor) -> None:
    # The kernels address a head's row with a unit stride over head_dim.
    if kv_cache.stride(-1) != 1:
        raise ValueError("kv_cache: the head dimension must be contiguous")
