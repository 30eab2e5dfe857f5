"""The Triton kernels against their plain references on random paged inputs of awkward shapes.

Without a GPU they run under the Triton interpreter (see tests/cuda/triton_interpreter.py).
"""

from __future__ import annotations

import pytest
import torch

from firsttoken.attention.backend import BatchLayout
from firsttoken.attention.reference import paged_attention_reference, write_kv_reference
from firsttoken.attention.triton_kernels import (
    ChunkQueries,
    _paged_attention_kernel,
    DecodeQueries,
    chunk_tiles,
    decode_tile_shape,
    paged_chunk_attention,
    paged_decode_attention,
    prefill_tile_shape,
    store_kv,
)
from tests.cuda.paged_inputs import random_paged_inputs
from tests.cuda.triton_interpreter import SLOW_ON_CPU

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
DTYPES = [torch.float32, torch.bfloat16]


def _shapes_in_each_dtype(shapes: list[tuple[int, ...]]) -> list:
    """Every shape in float32, the first in bf16 too; the other shapes in bf16 are the slow tier's
    without a GPU (bf16 changes the loads and the dot's inputs, not the tiling a shape exercises)."""
    return [
        pytest.param(
            *shape,
            dtype,
            marks=SLOW_ON_CPU if dtype != torch.float32 and index > 0 else [],
            id="-".join(map(str, shape)) + f"-{str(dtype).removeprefix('torch.')}",
        )
        for index, shape in enumerate(shapes)
        for dtype in DTYPES
    ]


def _block_tables(layout: BatchLayout, device: torch.device) -> torch.Tensor:
    width = max(len(sequence.block_table) for sequence in layout.sequences)
    table = torch.zeros(len(layout.sequences), width, dtype=torch.int32)
    for row, sequence in enumerate(layout.sequences):
        table[row, : len(sequence.block_table)] = torch.tensor(sequence.block_table, dtype=torch.int32)
    return table.to(device)


def _decode_queries(layout: BatchLayout, device: torch.device) -> DecodeQueries:
    seq_lens = torch.tensor([s.seq_len for s in layout.sequences], dtype=torch.int32, device=device)
    return DecodeQueries(_block_tables(layout, device), seq_lens)


def _chunk_queries(layout: BatchLayout, group: int, device: torch.device) -> ChunkQueries:
    chunks, first_row = [], 0
    for sequence in layout.sequences:
        chunks.append((first_row, sequence.num_context_tokens, sequence.query_len))
        first_row += sequence.query_len
    tiles = chunk_tiles(chunks, prefill_tile_shape(group).query_tokens)
    return ChunkQueries(_block_tables(layout, device), torch.tensor(tiles, dtype=torch.int32, device=device))


def test_tile_shapes_fold_the_heads_of_a_kv_head_into_at_least_16_rows():
    assert decode_tile_shape(1).rows == 16 and decode_tile_shape(1).query_tokens == 1
    assert decode_tile_shape(3).rows == 16
    assert decode_tile_shape(32).rows == 32
    assert prefill_tile_shape(1).query_tokens == 64 and prefill_tile_shape(1).rows == 64
    assert prefill_tile_shape(3).query_tokens == 21 and prefill_tile_shape(3).rows == 64
    assert prefill_tile_shape(128).query_tokens == 1 and prefill_tile_shape(128).rows == 128


def test_chunk_tiles_cover_every_query_row_once_with_its_position():
    tiles = chunk_tiles([(5, 17, 10), (15, 0, 1)], tile_tokens=4)
    assert tiles == [(0, 5, 17, 4), (0, 9, 21, 4), (0, 13, 25, 2), (1, 15, 0, 1)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_kv_heads,head_dim,block_size", [(3, 64, 16), (1, 48, 5), (8, 16, 1)])
def test_store_kv_matches_reference(device, dtype, num_kv_heads, head_dim, block_size):
    generator = torch.Generator().manual_seed(1)
    num_tokens, num_blocks = 37, 40
    # K and V as the model hands them over: strided views of one fused projection.
    fused = torch.randn(num_tokens, 3 * num_kv_heads * head_dim, generator=generator).to(dtype).to(device)
    key = fused[:, num_kv_heads * head_dim : 2 * num_kv_heads * head_dim].view(
        num_tokens, num_kv_heads, head_dim
    )
    value = fused[:, 2 * num_kv_heads * head_dim :].view(num_tokens, num_kv_heads, head_dim)
    slot_mapping = torch.randperm(num_blocks * block_size, generator=generator)[:num_tokens].to(device)
    cache = (
        torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=generator)
        .to(dtype)
        .to(device)
    )
    expected = cache.clone()
    write_kv_reference(expected, key, value, slot_mapping)
    store_kv(cache, key, value, slot_mapping.to(torch.int32))
    assert torch.equal(cache, expected)


@pytest.mark.parametrize("as_chunk_tiles", [False, True])
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,block_size,dtype",
    _shapes_in_each_dtype([(9, 3, 64, 16), (4, 4, 32, 5), (8, 1, 16, 1), (12, 2, 48, 16)]),
)
def test_paged_decode_attention_matches_reference(
    device, dtype, num_heads, num_kv_heads, head_dim, block_size, as_chunk_tiles
):
    seqs = [
        (0, 1),  # a one-token prompt: the query sees only itself
        (block_size - 1, 1),  # the new token is the last slot of a block
        (block_size, 1),  # the new token opens a block
        (2 * block_size + 1, 1),
        (1030 if block_size == 16 else 70, 1),  # a long context crosses many key tiles
    ]
    inputs = random_paged_inputs(
        seqs, len(seqs), block_size, num_heads, num_kv_heads, head_dim, dtype, device
    )
    store_kv(inputs.kv_cache, inputs.key, inputs.value, inputs.slot_mapping)
    output = torch.full_like(inputs.query, float("nan"))
    paged_decode_attention(
        output, inputs.query, inputs.kv_cache, _decode_queries(inputs.layout, device), as_chunk_tiles
    )
    expected = paged_attention_reference(inputs.query.cpu(), inputs.kv_cache.cpu(), inputs.layout)
    torch.testing.assert_close(
        output.cpu().float(), expected.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype]
    )


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,block_size,dtype",
    _shapes_in_each_dtype([(9, 3, 64, 16), (4, 4, 32, 5), (8, 1, 16, 1)]),
)
def test_paged_chunk_attention_matches_reference(
    device, dtype, num_heads, num_kv_heads, head_dim, block_size
):
    seqs = [
        (block_size * 3, 21),  # a chunk right after a block-aligned cached prefix
        (17, 40),  # after a mid-block prefix
        (5, 1),  # a one-token chunk
        (0, 23),  # no context: the kernel also covers a plain causal prefill
        (1030 if block_size == 16 else 90, 70),  # a long context
    ]
    inputs = random_paged_inputs(seqs, 0, block_size, num_heads, num_kv_heads, head_dim, dtype, device)
    store_kv(inputs.kv_cache, inputs.key, inputs.value, inputs.slot_mapping)
    output = torch.full_like(inputs.query, float("nan"))
    queries = _chunk_queries(inputs.layout, num_heads // num_kv_heads, device)
    paged_chunk_attention(output, inputs.query, inputs.kv_cache, queries)
    expected = paged_attention_reference(inputs.query.cpu(), inputs.kv_cache.cpu(), inputs.layout)
    torch.testing.assert_close(
        output.cpu().float(), expected.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype]
    )


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", [(9, 3, 64, 16), (4, 4, 32, 5)])
def test_a_tokens_attention_is_the_same_bits_in_any_chunk_and_as_a_decode(
    device, num_heads, num_kv_heads, head_dim, block_size
):
    """bf16 rows of one sequence (70 cached tokens, 60 new ones, all K/V in the cache): computed
    as one chunk, as chunks cut elsewhere (other tiles, other places in a tile), and each token
    as a decode on the chunk kernel's tiles (what a decode is before a preemption, and the
    prefill row it is recomputed as after)."""
    context, num_new = 70, 60
    inputs = random_paged_inputs([(context, num_new)], 0, block_size, num_heads, num_kv_heads, head_dim,
                                 torch.bfloat16, device)
    store_kv(inputs.kv_cache, inputs.key, inputs.value, inputs.slot_mapping)
    group = num_heads // num_kv_heads
    block_tables = _block_tables(inputs.layout, device)

    def as_chunks(cuts: list[int]) -> torch.Tensor:
        """The rows computed as the chunks [cuts[i], cuts[i + 1]) of the new tokens."""
        output = torch.full_like(inputs.query, float("nan"))
        chunks = [(start, context + start, end - start) for start, end in zip(cuts, cuts[1:])]
        for chunk in chunks:  # one launch per chunk, as steps of a chunked prefill
            tiles = torch.tensor(
                chunk_tiles([chunk], prefill_tile_shape(group).query_tokens), dtype=torch.int32
            )
            paged_chunk_attention(
                output, inputs.query, inputs.kv_cache, ChunkQueries(block_tables, tiles.to(device))
            )
        return output

    whole = as_chunks([0, num_new])
    for cuts in ([0, 1, 17, num_new], [0, 29, 30, 59, num_new]):
        assert torch.equal(as_chunks(cuts), whole), cuts
    for row in (0, 1, 20, 21, 45, num_new - 1):
        seq_lens = torch.tensor([context + row + 1], dtype=torch.int32, device=device)
        decoded = torch.full_like(inputs.query[row : row + 1], float("nan"))
        paged_decode_attention(decoded, inputs.query[row : row + 1], inputs.kv_cache,
                               DecodeQueries(block_tables, seq_lens), as_chunk_tiles=True)
        assert torch.equal(decoded[0], whole[row]), row


@pytest.mark.skipif(not torch.cuda.is_available(), reason="reads the compiled kernels' cache")
def test_a_decode_on_chunk_tiles_runs_the_binary_a_chunk_launch_compiled(device):
    inputs = random_paged_inputs([(70, 60)], 0, 16, 9, 3, 64, torch.bfloat16, device)
    store_kv(inputs.kv_cache, inputs.key, inputs.value, inputs.slot_mapping)
    block_tables = _block_tables(inputs.layout, device)
    tiles = chunk_tiles([(0, 70, 60)], prefill_tile_shape(3).query_tokens)
    output = torch.empty_like(inputs.query)
    queries = ChunkQueries(block_tables, torch.tensor(tiles, dtype=torch.int32, device=device))
    paged_chunk_attention(output, inputs.query, inputs.kv_cache, queries)
    compiled = _paged_attention_kernel.device_caches[torch.cuda.current_device()][0]
    binaries = set(compiled)
    seq_lens = torch.tensor([71, 75], dtype=torch.int32, device=device)
    decodes = DecodeQueries(block_tables.expand(2, -1).contiguous(), seq_lens)
    paged_decode_attention(output[:2], inputs.query[:2], inputs.kv_cache, decodes, as_chunk_tiles=True)
    assert set(compiled) == binaries


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_chunk_attention_on_a_1000_token_chunk(device, dtype):
    inputs = random_paged_inputs([(40, 1000)], 0, 16, 8, 2, 64, dtype, device)
    store_kv(inputs.kv_cache, inputs.key, inputs.value, inputs.slot_mapping)
    output = torch.full_like(inputs.query, float("nan"))
    paged_chunk_attention(output, inputs.query, inputs.kv_cache, _chunk_queries(inputs.layout, 4, device))
    expected = paged_attention_reference(inputs.query.cpu(), inputs.kv_cache.cpu(), inputs.layout)
    torch.testing.assert_close(
        output.cpu().float(), expected.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype]
    )
