"""The portable flash attention (csrc/attention.c) against plain math, on every ISA this CPU
runs, and the bits it promises: a row's result depends on nothing but its own inputs."""

from __future__ import annotations

import pytest
import torch


# float32 arithmetic throughout: what is left is summation order and the vector exp (~1e-7).
TOLERANCE = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
DTYPES = [torch.float32, torch.bfloat16]
SHAPES = [(9, 3, 64), (4, 4, 32), (8, 2, 128), (4, 1, 256), (2, 1, 16)]
# Key counts on and around the 64-key tiles; queries the last n of them.
QUERIES_KEYS = [(1, 1), (5, 5), (64, 64), (65, 129), (100, 100), (17, 300), (300, 300)]
POSITIONS_ON_TILE_EDGES = [0, 1, 7, 8, 15, 16, 63, 64, 65, 127, 128, 200, 299]


def _qkv(num_queries, num_keys, num_heads, num_kv_heads, head_dim, dtype, seed=0):
    """Query [n, heads, D] and key, value [m, kv_heads, D] as strided views of one qkv, as the model
    holds them."""
    generator = torch.Generator().manual_seed(seed)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(num_keys, width, generator=generator).to(dtype)
    query = qkv[-num_queries:, : num_heads * head_dim].view(num_queries, num_heads, head_dim)
    key = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(
        num_keys, num_kv_heads, head_dim
    )
    value = qkv[:, (num_heads + num_kv_heads) * head_dim :].view(num_keys, num_kv_heads, head_dim)
    return query, key, value


def _causal_attention_reference(query, key, value, window=0, softcap=0.0):
    num_queries, num_heads, head_dim = query.shape
    num_keys, num_kv_heads = key.shape[0], key.shape[1]
    group = num_heads // num_kv_heads
    scores = (
        torch.einsum("qhd,khd->hqk", query.float(), key.float().repeat_interleave(group, 1)) / head_dim**0.5
    )
    positions = torch.arange(num_keys - num_queries, num_keys)
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    offsets = positions[:, None] - torch.arange(num_keys)[None, :]
    allowed = (offsets >= 0) & ((offsets < window) if window else True)
    weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    return torch.einsum("hqk,khd->qhd", weights, value.float().repeat_interleave(group, 1))


def _paged(key, value, block_size, seed=1):
    """The same K/V in a paged cache [2, blocks, block_size, kv_heads, D], blocks shuffled, and
    the sequence's block ids."""
    num_keys, num_kv_heads, head_dim = key.shape
    num_blocks = -(-num_keys // block_size)
    block_ids = torch.randperm(num_blocks + 2, generator=torch.Generator().manual_seed(seed))[:num_blocks]
    kv_cache = torch.zeros(2, num_blocks + 2, block_size, num_kv_heads, head_dim, dtype=key.dtype)
    positions = torch.arange(num_keys)
    slots = block_ids[positions // block_size] * block_size + positions % block_size
    kv_cache[0].view(-1, num_kv_heads, head_dim)[slots] = key
    kv_cache[1].view(-1, num_kv_heads, head_dim)[slots] = value
    return kv_cache, block_ids


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", SHAPES)
@pytest.mark.parametrize("num_queries,num_keys", QUERIES_KEYS)
def test_flash_attention_matches_plain_math(
    kernels, dtype, num_heads, num_kv_heads, head_dim, num_queries, num_keys
):
    query, key, value = _qkv(num_queries, num_keys, num_heads, num_kv_heads, head_dim, dtype)
    assert kernels.flash.flash_attention_supports(query, key)
    output = kernels.flash.flash_attention(query, key, value, num_threads=2)
    assert output.dtype == dtype
    torch.testing.assert_close(
        output.float(), _causal_attention_reference(query, key, value), **TOLERANCE[dtype]
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (8, 2, 128)])
def test_a_row_has_the_same_bits_whatever_the_other_rows_and_threads(
    kernels, dtype, num_heads, num_kv_heads, head_dim
):
    """The last rows of a 300-token prefill, as a chunk of 1, 17 or 70 queries on the others'
    keys, on one thread or two: the same bits."""
    query, key, value = _qkv(300, 300, num_heads, num_kv_heads, head_dim, dtype)
    whole = kernels.flash.flash_attention(query, key, value, num_threads=2)
    for num_queries in (1, 17, 70):
        for threads in (1, 2):
            chunk = kernels.flash.flash_attention(query[-num_queries:], key, value, num_threads=threads)
            assert torch.equal(chunk, whole[-num_queries:])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("num_queries,num_keys", [(1, 1), (21, 60), (40, 300)])
def test_a_chunk_reads_its_paged_context_in_place_with_the_bits_of_consecutive_keys(
    kernels, dtype, block_size, num_queries, num_keys
):
    query, key, value = _qkv(num_queries, num_keys, 9, 3, 64, dtype)
    kv_cache, block_ids = _paged(key, value, block_size)
    paged = kernels.flash.flash_attention_paged(query, kv_cache, block_ids, num_keys, num_threads=2)
    assert torch.equal(paged, kernels.flash.flash_attention(query, key, value, num_threads=2))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", SHAPES)
@pytest.mark.parametrize("block_size", [16, 5])
def test_decode_rows_get_the_bits_a_prefill_gives_their_positions(
    kernels, dtype, num_heads, num_kv_heads, head_dim, block_size
):
    """Each decode row, at positions on and across the 8-, 16- and 64-key tiles, equals bit for
    bit its row in one prefill of the whole sequence, alone or beside the others."""
    num_keys = 300
    query, key, value = _qkv(num_keys, num_keys, num_heads, num_kv_heads, head_dim, dtype, seed=head_dim)
    prefill = kernels.flash.flash_attention(query, key, value, num_threads=2)
    kv_cache, block_ids = _paged(key, value, block_size)
    positions = torch.tensor(POSITIONS_ON_TILE_EDGES)
    block_table = block_ids.repeat(len(positions), 1)
    decoded = kernels.flash.flash_decode_attention(query[positions], kv_cache, block_table, positions + 1)
    assert torch.equal(decoded, prefill[positions])
    alone = kernels.flash.flash_decode_attention(
        query[positions[-2:]], kv_cache, block_table[-2:], positions[-2:] + 1
    )
    assert torch.equal(alone, prefill[positions[-2:]])


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_given_out_slice_gets_the_bits_a_new_tensor_gets(kernels, dtype):
    query, key, value = _qkv(40, 100, 9, 3, 64, dtype)
    kv_cache, block_ids = _paged(key, value, 16)
    fresh = kernels.flash.flash_attention(query, key, value, num_threads=2)
    step_output = torch.full((44, 9, 64), float("nan"), dtype=dtype)
    rows = step_output[2:42]
    assert kernels.flash.flash_attention(query, key, value, num_threads=2, out=rows) is rows
    assert torch.equal(step_output[2:42], fresh)
    assert step_output[:2].isnan().all() and step_output[42:].isnan().all()
    step_output.fill_(float("nan"))
    kernels.flash.flash_attention_paged(query, kv_cache, block_ids, 100, num_threads=2, out=rows)
    assert torch.equal(step_output[2:42], fresh)
    with pytest.raises(ValueError, match="flash_attention_paged: out must be a contiguous CPU"):
        kernels.flash.flash_attention_paged(query, kv_cache, block_ids, 100, num_threads=2, out=rows[:, :3])


def test_bad_shapes_and_tables_are_named(kernels):
    query, key, value = _qkv(8, 8, 4, 4, 64, torch.float32)
    with pytest.raises(ValueError, match="8 queries of 4 heads over 4 keys"):
        kernels.flash.flash_attention(query, key[:4], value[:4], num_threads=1)
    odd = torch.zeros(1, 2, 12)
    assert not kernels.flash.flash_attention_supports(odd, odd)  # head size not whole vectors
    assert not kernels.flash.flash_attention_supports(query, key.to(torch.bfloat16))
    kv_cache = torch.zeros(2, 4, 16, 4, 64)
    with pytest.raises(IndexError, match="outside the KV cache"):
        kernels.flash.flash_attention_paged(query, kv_cache, torch.tensor([0, 4]), 20, num_threads=1)
    with pytest.raises(IndexError, match="outside the KV cache"):
        kernels.flash.flash_attention_paged(query, kv_cache, torch.tensor([0]), 20, num_threads=1)
    with pytest.raises(IndexError, match="outside the KV cache"):
        kernels.flash.flash_decode_attention(query[:1], kv_cache, torch.tensor([[0, 1]]), torch.tensor([33]))
    with pytest.raises(ValueError, match="block table"):
        kernels.flash.flash_decode_attention(
            query[:1], kv_cache, torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([9])
        )


# Windows inside a tile, on its edge, across several tiles, and wider than every sequence.
WINDOWS = [1, 5, 16, 64, 65, 130, 1000]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("num_queries,num_keys", [(1, 1), (64, 64), (65, 129), (17, 300), (300, 300)])
def test_a_sliding_window_matches_plain_math(kernels, dtype, window, num_queries, num_keys):
    query, key, value = _qkv(num_queries, num_keys, 9, 3, 64, dtype)
    output = kernels.flash.flash_attention(query, key, value, num_threads=2, window=window)
    torch.testing.assert_close(
        output.float(), _causal_attention_reference(query, key, value, window), **TOLERANCE[dtype]
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [5, 64, 100])
def test_windowed_chunks_and_decode_rows_get_the_bits_of_one_prefill(kernels, dtype, window):
    """A windowed row's bits depend on its inputs only: as a chunk on cached context (in place,
    through block ids) and as a decode row, alone or beside others, it equals its prefill row."""
    num_keys = 300
    query, key, value = _qkv(num_keys, num_keys, 9, 3, 64, dtype)
    prefill = kernels.flash.flash_attention(query, key, value, num_threads=2, window=window)
    kv_cache, block_ids = _paged(key, value, 16)
    chunk = kernels.flash.flash_attention_paged(
        query[-70:], kv_cache, block_ids, num_keys, num_threads=1, window=window
    )
    assert torch.equal(chunk, prefill[-70:])
    positions = torch.tensor(POSITIONS_ON_TILE_EDGES)
    block_table = block_ids.repeat(len(positions), 1)
    decoded = kernels.flash.flash_decode_attention(
        query[positions], kv_cache, block_table, positions + 1, window=window
    )
    assert torch.equal(decoded, prefill[positions])


def test_blocks_before_every_window_are_never_read(kernels):
    """Blocks wholly before the window hold NaN (as if freed and reused): the output stays finite
    and equal to the intact cache's."""
    window, block_size, num_keys = 40, 16, 200
    query, key, value = _qkv(num_keys, num_keys, 9, 3, 64, torch.float32)
    kv_cache, block_ids = _paged(key, value, block_size)
    intact = kernels.flash.flash_attention_paged(
        query[-30:], kv_cache, block_ids, num_keys, num_threads=2, window=window
    )
    first_seen = num_keys - 30 - window + 1
    kv_cache[:, block_ids[: first_seen // block_size]] = float("nan")
    assert torch.equal(
        kernels.flash.flash_attention_paged(
            query[-30:], kv_cache, block_ids, num_keys, num_threads=2, window=window
        ),
        intact,
    )
    last = torch.tensor([num_keys - 1])
    decoded = kernels.flash.flash_decode_attention(
        query[last], kv_cache, block_ids[None], last + 1, window=window
    )
    assert torch.equal(decoded, intact[-1:])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("softcap,window", [(0.5, 0), (2.0, 0), (50.0, 0), (1.0, 40)])
def test_soft_capped_scores_match_plain_math_and_keep_a_rows_bits(kernels, dtype, softcap, window):
    """Gemma 2's cap * tanh(score / cap), with and without a window; a decode row still gets the
    bits its prefill row does."""
    num_keys = 200
    query, key, value = _qkv(num_keys, num_keys, 9, 3, 64, dtype, seed=3)
    query = query * 4  # scores of several units: the cap bends them
    output = kernels.flash.flash_attention(query, key, value, num_threads=2, window=window, softcap=softcap)
    torch.testing.assert_close(
        output.float(), _causal_attention_reference(query, key, value, window, softcap), **TOLERANCE[dtype]
    )
    kv_cache, block_ids = _paged(key, value, 16)
    positions = torch.tensor([0, 63, 64, 150, 199])
    decoded = kernels.flash.flash_decode_attention(
        query[positions].contiguous(),
        kv_cache,
        block_ids.repeat(len(positions), 1),
        positions + 1,
        window=window,
        softcap=softcap,
    )
    assert torch.equal(decoded, output[positions])


def _sinks_reference(query, sink_query, key, value, window, sink_tokens):
    """Each query over its window's keys and, once its window has left them, the first
    sink_tokens keys scored with its sink query: one softmax over both (float32)."""
    num_queries, num_heads, head_dim = query.shape
    num_keys, num_kv_heads = key.shape[0], key.shape[1]
    group = num_heads // num_kv_heads
    keys = key.float().repeat_interleave(group, 1)
    values = value.float().repeat_interleave(group, 1)
    outputs = []
    for row, position in enumerate(range(num_keys - num_queries, num_keys)):
        start = max(0, position - window + 1)
        if start <= sink_tokens:
            visible = list(range(position + 1))
            rows = query[row].float().expand(len(visible), -1, -1)
        else:
            visible = list(range(sink_tokens)) + list(range(start, position + 1))
            rows = torch.cat(
                [
                    sink_query[row].float().expand(sink_tokens, -1, -1),
                    query[row].float().expand(position + 1 - start, -1, -1),
                ]
            )
        scores = (rows * keys[visible]).sum(-1) / head_dim**0.5  # [visible, heads]
        weights = scores.softmax(0)
        outputs.append((weights[..., None] * values[visible]).sum(0))
    return torch.stack(outputs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sink_tokens,window", [(4, 16), (4, 64), (1, 5), (64, 70)])
def test_attention_sinks_beside_a_window_match_plain_math_and_keep_a_rows_bits(
    kernels, dtype, sink_tokens, window
):
    """StreamingLLM: a row whose window has left the sinks scores them with its sink query; a
    decode row and a paged chunk get its prefill row's bits; the blocks between the sinks and
    the window are never read."""
    num_keys = 200
    query, key, value = _qkv(num_keys, num_keys, 9, 3, 64, dtype, seed=5)
    sink_query = _qkv(num_keys, num_keys, 9, 3, 64, dtype, seed=6)[0].contiguous()
    sinks = dict(window=window, sink_tokens=sink_tokens)
    output = kernels.flash.flash_attention(query, key, value, num_threads=2, sink_query=sink_query, **sinks)
    torch.testing.assert_close(
        output.float(),
        _sinks_reference(query, sink_query, key, value, window, sink_tokens),
        **TOLERANCE[dtype],
    )
    kv_cache, block_ids = _paged(key, value, 8)
    first_kept = -(-sink_tokens // 8)
    first_seen = num_keys - 60 - window + 1
    kv_cache[:, block_ids[first_kept : max(first_kept, first_seen // 8)]] = float("nan")
    chunk = kernels.flash.flash_attention_paged(
        query[-60:], kv_cache, block_ids, num_keys, num_threads=1, sink_query=sink_query[-60:], **sinks
    )
    assert torch.equal(chunk, output[-60:])
    positions = torch.tensor([150, 199])
    decoded = kernels.flash.flash_decode_attention(
        query[positions].contiguous(),
        kv_cache,
        block_ids.repeat(2, 1),
        positions + 1,
        sink_query=sink_query[positions].contiguous(),
        **sinks,
    )
    assert torch.equal(decoded, output[positions])
