"""The CPU paged-attention backend against the plain-math reference on random paged inputs."""

from __future__ import annotations

import pytest
import torch

from firsttoken.attention.backend import BatchLayout, LayerAttention, SequenceLayout
from firsttoken.attention.reference import paged_attention_reference, write_kv_reference
from firsttoken.attention.cpu_backend import FLASH_MAX_QUERIES_BESIDE_SDPA, CPUAttentionBackend, first_of_run

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def _random_batch(seqs, block_size, num_heads, num_kv_heads, head_dim, dtype, seed=0, in_order=False):
    """seqs: list of (num_context_tokens, query_len). Blocks are handed out shuffled, so
    every block table is non-contiguous, or `in_order` (one run of ids per sequence, after
    three leading blocks). The context K/V is written to the cache first."""
    generator = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-(ctx + q) // block_size) for ctx, q in seqs]
    num_blocks = sum(blocks_needed) + 3
    order = (
        list(range(3, num_blocks)) if in_order else torch.randperm(num_blocks, generator=generator).tolist()
    )
    kv_cache = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    sequences, cursor = [], 0
    for (ctx, q), needed in zip(seqs, blocks_needed):
        table = order[cursor : cursor + needed]
        cursor += needed
        sequences.append(SequenceLayout(query_len=q, num_context_tokens=ctx, block_table=table))
        if ctx:
            positions = torch.arange(ctx)
            slots = torch.tensor(table)[positions // block_size] * block_size + positions % block_size
            write_kv_reference(
                kv_cache,
                torch.randn(ctx, num_kv_heads, head_dim, generator=generator).to(dtype),
                torch.randn(ctx, num_kv_heads, head_dim, generator=generator).to(dtype),
                slots,
            )
    num_decodes = sum(1 for s in sequences if s.query_len == 1)
    assert all(s.query_len == 1 for s in sequences[:num_decodes])
    layout = BatchLayout(sequences, num_decodes, block_size)
    slot_mapping = torch.cat(
        [
            torch.tensor(s.block_table)[torch.arange(s.num_context_tokens, s.seq_len) // block_size]
            * block_size
            + torch.arange(s.num_context_tokens, s.seq_len) % block_size
            for s in sequences
        ]
    )
    total = layout.num_tokens
    query = torch.randn(total, num_heads, head_dim, generator=generator).to(dtype)
    key = torch.randn(total, num_kv_heads, head_dim, generator=generator).to(dtype)
    value = torch.randn(total, num_kv_heads, head_dim, generator=generator).to(dtype)
    return layout, slot_mapping, kv_cache, query, key, value


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim", [(9, 3, 64), (4, 4, 32), (8, 1, 16)]
)
@pytest.mark.parametrize("block_size", [1, 16, 5])
@pytest.mark.parametrize("with_native", [False, True])
def test_cpu_backend_matches_reference(
    dtype, num_heads, num_kv_heads, head_dim, block_size, with_native, native_kernels
):
    seqs = [
        (30, 1),  # decodes with different context lengths, including a block boundary
        (block_size * 2 - 1, 1),
        (0, 1),  # a one-token prompt
        (0, 37),  # a fresh prefill
        (block_size * 3, 21),  # a chunk after a block-aligned cached prefix
        (17, 1000 if block_size == 16 else 40),  # a chunk after a mid-block prefix; one long
    ]
    layout, slot_mapping, kv_cache, query, key, value = _random_batch(
        seqs, block_size, num_heads, num_kv_heads, head_dim, dtype
    )
    kernels = _native_or_skip(native_kernels) if with_native else None
    backend = CPUAttentionBackend(torch.device("cpu"), kernels)
    metadata = backend.build_metadata(layout, slot_mapping)
    output = backend.forward(query, key, value, kv_cache, metadata)
    expected = paged_attention_reference(query, kv_cache, layout)
    torch.testing.assert_close(output.float(), expected.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def _native_or_skip(native_kernels):
    if native_kernels is None:
        pytest.skip("no working C compiler on this machine")
    return native_kernels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_context_tokens", [0, 15, 16, 40])
def test_lone_decode_cut_to_its_length_matches_reference(dtype, num_context_tokens):
    """A batch's only decode attends over its keys cut to length, with no mask."""
    layout, slot_mapping, kv_cache, query, key, value = _random_batch(
        [(num_context_tokens, 1), (5, 9)], 16, 9, 3, 64, dtype
    )
    backend = CPUAttentionBackend(torch.device("cpu"))
    metadata = backend.build_metadata(layout, slot_mapping)
    assert metadata.decode_key_mask is None and metadata.decode_num_keys == num_context_tokens + 1
    output = backend.forward(query, key, value, kv_cache, metadata)
    expected = paged_attention_reference(query, kv_cache, layout)
    torch.testing.assert_close(output.float(), expected.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_first_of_run_finds_consecutive_ids_only():
    assert first_of_run([7]) == 7
    assert first_of_run([4, 5, 6]) == 4
    assert first_of_run([4, 6, 5]) is None
    assert first_of_run([6, 5, 4]) is None
    assert first_of_run([1, 3, 3]) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seqs", [[(40, 1)], [(31, 1), (0, 5)], [(16, 20), (33, 7)], [(100, 200)]])
@pytest.mark.parametrize("with_native", [False, True])
def test_contexts_in_consecutive_blocks_are_read_in_place_and_match_reference(
    dtype, seqs, with_native, native_kernels, monkeypatch
):
    """With native kernels (AVX512-BF16 or AMX), every bf16 prefill here takes one native call."""
    layout, slot_mapping, kv_cache, query, key, value = _random_batch(
        seqs, 16, 9, 3, 64, dtype, in_order=True
    )
    kernels = _native_or_skip(native_kernels) if with_native else None
    backend = CPUAttentionBackend(torch.device("cpu"), kernels)
    native_calls = []
    if with_native:
        attend = native_kernels.attention.prefill_attention
        monkeypatch.setattr(
            native_kernels.attention, "prefill_attention", _counted(attend, 1, native_calls)
        )
    metadata = backend.build_metadata(layout, slot_mapping)
    if layout.num_decodes == 1:
        assert metadata.decode_first_block is not None and metadata.decode_block_table is None
    for span in metadata.prefills:
        if span.num_context_tokens:
            assert span.context_first_block is not None and span.sequence_block_ids is None
            assert span.sequence_first_block == span.context_first_block
    output = backend.forward(query, key, value, kv_cache, metadata)
    expected = paged_attention_reference(query, kv_cache, layout)
    torch.testing.assert_close(output.float(), expected.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    uses_native = with_native and dtype == torch.bfloat16 and native_kernels.attention.has_prefill_attention
    assert len(native_calls) == (len(metadata.prefills) if uses_native else 0)


def _relabelled(layout, slot_mapping, kv_cache, generator):
    """The same batch with its blocks moved to shuffled ids: same K/V, scattered block tables."""
    block_size, num_blocks = layout.block_size, kv_cache.shape[1]
    new_id = torch.randperm(num_blocks, generator=generator)
    moved_cache = torch.empty_like(kv_cache)
    moved_cache[:, new_id] = kv_cache
    sequences = [
        SequenceLayout(s.query_len, s.num_context_tokens, [int(new_id[b]) for b in s.block_table])
        for s in layout.sequences
    ]
    moved_slots = new_id[slot_mapping // block_size] * block_size + slot_mapping % block_size
    return BatchLayout(sequences, layout.num_decodes, block_size), moved_slots, moved_cache


@pytest.mark.parametrize("seqs", [[(16, 20), (33, 7)], [(31, 1), (100, 200)], [(5, 40)]])
def test_scattered_context_takes_the_native_kernel_with_the_in_place_bits(seqs, native_kernels, monkeypatch):
    """A chunk on cached context whose blocks are scattered gathers them once and runs the same
    native kernel: the bits of the same step laid out in consecutive blocks."""
    native_kernels = _native_or_skip(native_kernels)
    if not native_kernels.attention.has_prefill_attention:
        pytest.skip("no native prefill attention on this CPU")
    layout, slot_mapping, kv_cache, query, key, value = _random_batch(
        seqs, 16, 9, 3, 64, torch.bfloat16, in_order=True
    )
    scattered = _relabelled(layout, slot_mapping, kv_cache, torch.Generator().manual_seed(1))
    assert all(first_of_run(s.block_table) is None for s in scattered[0].sequences if len(s.block_table) > 1)
    native_calls = []
    attend = native_kernels.attention.prefill_attention
    monkeypatch.setattr(
        native_kernels.attention, "prefill_attention", _counted(attend, 1, native_calls)
    )
    backend = CPUAttentionBackend(torch.device("cpu"), native_kernels)
    outputs = []
    for step_layout, step_slots, step_cache in [(layout, slot_mapping, kv_cache), scattered]:
        metadata = backend.build_metadata(step_layout, step_slots)
        outputs.append(backend.forward(query, key, value, step_cache, metadata))
    num_prefills = sum(1 for s in layout.sequences if s.query_len > 1)
    assert len(native_calls) == 2 * num_prefills
    assert torch.equal(outputs[0], outputs[1])
    expected = paged_attention_reference(query, scattered[2], scattered[0])
    torch.testing.assert_close(outputs[1].float(), expected.float(), atol=TOLERANCE[torch.bfloat16], rtol=0)


# Three decodes (70, 200 and 3 cached tokens), a fresh prompt of 40 and a chunk of 17 on 33 cached.
MIXED_SEQUENCES = [(70, 1), (200, 1), (3, 1), (0, 40), (33, 17)]


def _decode_row_beside_others(
    backend: CPUAttentionBackend, batch: tuple, tolerance: float
) -> list[torch.Tensor]:
    """The first decode row's output alone, beside the other two decodes, and beside the prompt
    and the chunk (`batch`: `_random_batch` of MIXED_SEQUENCES), each step checked against the
    reference within `tolerance`."""
    layout, slot_mapping, kv_cache, query, key, value = batch
    row_starts = [0, 1, 2, 3, 43, 60]
    first_rows = []
    for picked in ([0], [0, 1, 2], [0, 3, 4]):
        rows = torch.cat([torch.arange(row_starts[i], row_starts[i + 1]) for i in picked])
        sequences = [layout.sequences[i] for i in picked]
        part = BatchLayout(sequences, sum(1 for s in sequences if s.query_len == 1), layout.block_size)
        metadata = backend.build_metadata(part, slot_mapping[rows])
        output = backend.forward(query[rows], key[rows], value[rows], kv_cache, metadata)
        expected = paged_attention_reference(query[rows], kv_cache, part)
        torch.testing.assert_close(output.float(), expected.float(), atol=tolerance, rtol=tolerance)
        first_rows.append(output[0])
    return first_rows


def _decode_kernels_or_skip(native_kernels):
    if native_kernels is None or not native_kernels.has_decode_kernels:
        pytest.skip("no native decode kernels on this machine (needs a C compiler and AVX512-BF16)")
    return native_kernels


@pytest.mark.parametrize("decode_as_prefill", [False, True])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_bf16_decode_rows_take_the_paged_kernel_and_give_the_same_bits_whatever_the_batch(
    native_kernels, head_dim, decode_as_prefill, monkeypatch
):
    """A decode row's attention is one native call reading the paged cache in place, the
    same bits alone, beside other decodes or beside prefill chunks."""
    kernels = _decode_kernels_or_skip(native_kernels)
    calls = []
    attend = kernels.attention.paged_decode_attention
    monkeypatch.setattr(
        kernels.attention,
        "paged_decode_attention",
        lambda *args, **kwargs: calls.append(kwargs) or attend(*args, **kwargs),
    )
    backend = CPUAttentionBackend(torch.device("cpu"), kernels, decode_as_prefill=decode_as_prefill)
    batch = _random_batch(MIXED_SEQUENCES, 16, 8, 2, head_dim, torch.bfloat16)
    first_rows = _decode_row_beside_others(backend, batch, tolerance=2e-2)
    assert calls == [{"as_prefill": decode_as_prefill, "window": 0, "softcap": 0.0}] * 3
    assert torch.equal(first_rows[0], first_rows[1])
    assert torch.equal(first_rows[0], first_rows[2])


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim",
    # groups of 1 to 7 query heads; heads of 96 and 128 dims take a group in passes of two
    [(9, 3, 64), (16, 4, 32), (5, 5, 64), (8, 2, 96), (7, 1, 128), (12, 3, 128)],
)
def test_exact_paged_decode_rows_give_the_same_bits_alone_as_in_a_batch(
    native_kernels, num_heads, num_kv_heads, head_dim
):
    """The exact paged kernel attends a lone row head by head and a wide batch a KV head's
    whole group at a time (each key read once for all its query heads): every head's bits
    are the same either way, and the plain math's to bf16's tolerance."""
    kernels = _decode_kernels_or_skip(native_kernels)
    context_lengths = [0, 1, 14, 15, 16, 30, 32, 99, 256, 299, 63, 4]
    layout, _, kv_cache, query, _, _ = _random_batch(
        [(length, 1) for length in context_lengths], 16, num_heads, num_kv_heads, head_dim, torch.bfloat16,
        seed=head_dim + num_heads,
    )
    widest = max(len(sequence.block_table) for sequence in layout.sequences)
    block_table = torch.zeros(len(context_lengths), widest, dtype=torch.long)
    for row, sequence in enumerate(layout.sequences):
        block_table[row, : len(sequence.block_table)] = torch.tensor(sequence.block_table)
    # the new token's K/V: what the cache holds at its slot (zeros here), as the reference reads it
    seq_lens = torch.tensor(context_lengths) + 1
    batched = kernels.attention.paged_decode_attention(query, kv_cache, block_table, seq_lens)
    for row in range(len(context_lengths)):
        alone = kernels.attention.paged_decode_attention(
            query[row : row + 1], kv_cache, block_table[row : row + 1], seq_lens[row : row + 1]
        )
        assert torch.equal(alone[0], batched[row]), row
    expected = paged_attention_reference(query, kv_cache, layout)
    torch.testing.assert_close(batched.float(), expected.float(), atol=2e-2, rtol=2e-2)


POSITIONS_ON_TILE_EDGES = [0, 1, 15, 16, 31, 32, 63, 64, 65, 127, 128, 200, 299]


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (4, 4, 32), (8, 2, 128)])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize(
    "positions",
    # On one thread: contexts under 1 MB packed go in two phases (pack all, then attend), more
    # are packed and attended per (row, KV head).
    [POSITIONS_ON_TILE_EDGES, POSITIONS_ON_TILE_EDGES * 3],
    ids=["packed-first", "per-kv-head"],
)
def test_decode_rows_as_prefill_get_the_bits_a_prefill_gives_their_positions(
    native_kernels, one_thread, num_heads, num_kv_heads, head_dim, block_size, positions
):
    """Each decode row, at positions on and across the kernel's 16-, 32- and 64-key tiles,
    equals bit for bit its row in one prefill of the whole sequence."""
    kernels = _decode_kernels_or_skip(native_kernels)
    num_keys = 300
    layout, _, kv_cache, _, _, _ = _random_batch(
        [(num_keys, 1)], block_size, num_heads, num_kv_heads, head_dim, torch.bfloat16, seed=head_dim
    )
    block_ids = torch.tensor(layout.sequences[0].block_table)
    keys = kv_cache[0][block_ids].flatten(0, 1)[:num_keys]
    values = kv_cache[1][block_ids].flatten(0, 1)[:num_keys]
    query = torch.randn(num_keys, num_heads, head_dim, generator=torch.Generator().manual_seed(1)).to(
        torch.bfloat16
    )
    prefill = kernels.attention.prefill_attention(query, keys, values, num_threads=2)
    block_table = block_ids.repeat(len(positions), 1)
    seq_lens = torch.tensor(positions) + 1
    decoded = kernels.attention.paged_decode_attention(
        query[positions], kv_cache, block_table, seq_lens, as_prefill=True
    )
    assert torch.equal(decoded, prefill[positions])
    exact = kernels.attention.paged_decode_attention(query[positions], kv_cache, block_table, seq_lens)
    torch.testing.assert_close(decoded.float(), exact.float(), atol=2e-2, rtol=2e-2)


def test_decode_rows_as_prefill_need_blocks_of_whole_16_key_tiles(native_kernels):
    kernels = _decode_kernels_or_skip(native_kernels)
    kv_cache = torch.zeros(2, 8, 8, 2, 64, dtype=torch.bfloat16)
    query = torch.zeros(1, 4, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="blocks of 8"):
        kernels.attention.paged_decode_attention(
            query, kv_cache, torch.tensor([[0, 1]]), torch.tensor([9]), as_prefill=True
        )
    assert not CPUAttentionBackend(torch.device("cpu"), kernels, decode_as_prefill=True).decodes_as_prefill(
        8, torch.bfloat16, 64
    )


@pytest.mark.parametrize("as_prefill", [False, True])
def test_paged_decode_attention_rejects_a_block_outside_the_cache(native_kernels, as_prefill):
    kernels = _decode_kernels_or_skip(native_kernels)
    kv_cache = torch.zeros(2, 4, 16, 2, 64, dtype=torch.bfloat16)
    query = torch.zeros(1, 4, 64, dtype=torch.bfloat16)
    with pytest.raises(IndexError, match="outside the KV cache"):
        kernels.attention.paged_decode_attention(
            query, kv_cache, torch.tensor([[0, 4]]), torch.tensor([20]), as_prefill
        )
    with pytest.raises(IndexError, match="outside the KV cache"):
        kernels.attention.paged_decode_attention(
            query, kv_cache, torch.tensor([[0, 1]]), torch.tensor([33]), as_prefill
        )
    with pytest.raises(ValueError, match="block table"):
        kernels.attention.paged_decode_attention(
            query, kv_cache, torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([20])
        )


def _flash_kernels_or_skip(native_kernels, dtype):
    """The kernels when the portable flash kernel serves `dtype` here (not the AVX512-BF16 ones)."""
    kernels = _native_or_skip(native_kernels)
    if dtype == torch.bfloat16 and kernels.has_decode_kernels:
        pytest.skip("bf16 takes the AVX512-BF16 kernels on this CPU")
    return kernels


def _counting(kernels, monkeypatch, *names):
    calls = {name: 0 for name in names}
    for name in names:
        original = getattr(kernels, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(kernels, name, counted)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_order", [False, True])
def test_portable_flash_takes_every_row_and_decodes_get_a_prefills_bits(
    dtype, in_order, native_kernels, monkeypatch
):
    """Without the AVX512-BF16 kernels: fresh prefills, chunks on cached context (blocks in a
    run or scattered) and decode rows each take one portable flash call; a decode row gives the
    same bits alone, beside decodes or beside chunks, and the bits a prefill of the same tokens
    gives its position."""
    kernels = _flash_kernels_or_skip(native_kernels, dtype)
    calls = _counting(
        kernels.flash, monkeypatch, "flash_attention", "flash_attention_paged", "flash_decode_attention"
    )
    backend = CPUAttentionBackend(torch.device("cpu"), kernels, decode_as_prefill=True)
    assert backend.decodes_as_prefill(16, dtype, 64)
    batch = _random_batch(MIXED_SEQUENCES, 16, 9, 3, 64, dtype, in_order=in_order)
    layout, _, kv_cache, query, _, _ = batch
    first_rows = _decode_row_beside_others(backend, batch, tolerance=TOLERANCE[dtype])
    assert calls["flash_decode_attention"] == 3
    assert calls["flash_attention"] + calls["flash_attention_paged"] == 2  # the fresh prompt and the chunk
    assert calls["flash_attention_paged"] == (0 if in_order else 1)
    assert torch.equal(first_rows[0], first_rows[1]) and torch.equal(first_rows[0], first_rows[2])
    # The decode row's sequence (70 cached tokens and 1 new) as a chunk of 71 on nothing cached.
    decoded = layout.sequences[0]
    positions = torch.arange(decoded.seq_len)
    slots = torch.tensor(decoded.block_table)[positions // 16] * 16 + positions % 16
    keys, values = kv_cache[0].flatten(0, 1)[slots], kv_cache[1].flatten(0, 1)[slots]
    queries = torch.randn(decoded.seq_len, 9, 64).to(dtype)
    queries[-1] = query[0]
    as_prefill = BatchLayout([SequenceLayout(decoded.seq_len, 0, decoded.block_table)], 0, 16)
    prefill = backend.forward(
        queries, keys, values, kv_cache.clone(), backend.build_metadata(as_prefill, slots)
    )
    assert torch.equal(prefill[-1], first_rows[0])


def test_without_native_kernels_decodes_do_not_take_a_prefills_arithmetic():
    assert not CPUAttentionBackend(torch.device("cpu"), None, decode_as_prefill=True).decodes_as_prefill(
        16, torch.float32, 64
    )


@pytest.mark.parametrize("decode_as_prefill", [False, True])
def test_long_chunks_take_sdpa_unless_decodes_need_the_prefills_bits(
    decode_as_prefill, native_kernels, monkeypatch
):
    kernels = _flash_kernels_or_skip(native_kernels, torch.float32)
    calls = _counting(kernels.flash, monkeypatch, "flash_attention")
    backend = CPUAttentionBackend(torch.device("cpu"), kernels, decode_as_prefill=decode_as_prefill)
    num_tokens = FLASH_MAX_QUERIES_BESIDE_SDPA + 1
    layout, slot_mapping, kv_cache, query, key, value = _random_batch(
        [(0, num_tokens), (0, 40)], 16, 2, 1, 16, torch.float32
    )
    output = backend.forward(query, key, value, kv_cache, backend.build_metadata(layout, slot_mapping))
    assert calls["flash_attention"] == (2 if decode_as_prefill else 1)
    expected = paged_attention_reference(query, kv_cache, layout)
    torch.testing.assert_close(output, expected, atol=TOLERANCE[torch.float32], rtol=TOLERANCE[torch.float32])


@pytest.mark.parametrize(
    "flash_max_queries,flash_calls", [(None, 2), (40, 1), (0, 0)], ids=["no-limit", "limit-40", "limit-0"]
)
def test_a_measured_limit_sends_longer_prompts_to_sdpa(
    native_kernels, monkeypatch, flash_max_queries, flash_calls
):
    """Prompts of 41 and 40 tokens without invariance: the native kernel takes those within the
    limit (None: all), SDPA the others; every row as the reference computes it."""
    kernels = _flash_kernels_or_skip(native_kernels, torch.float32)
    calls = _counting(kernels.flash, monkeypatch, "flash_attention")
    backend = CPUAttentionBackend(torch.device("cpu"), kernels, flash_max_queries=flash_max_queries)
    layout, slot_mapping, kv_cache, query, key, value = _random_batch(
        [(0, 41), (0, 40)], 16, 2, 1, 16, torch.float32
    )
    output = backend.forward(query, key, value, kv_cache, backend.build_metadata(layout, slot_mapping))
    assert calls["flash_attention"] == flash_calls
    expected = paged_attention_reference(query, kv_cache, layout)
    torch.testing.assert_close(output, expected, atol=TOLERANCE[torch.float32], rtol=TOLERANCE[torch.float32])


@pytest.mark.parametrize("window", [24, 100])
@pytest.mark.parametrize("in_order", [False, True], ids=["gathered", "in-place"])
@pytest.mark.parametrize("decode_as_prefill", [False, True])
def test_windowed_bf16_rows_on_the_vector_kernels_match_reference_without_reading_before_the_window(
    native_kernels, monkeypatch, window, in_order, decode_as_prefill
):
    """Decodes, a fresh prompt and chunks on cached context longer than the window, the blocks
    wholly before each sequence's first query's window filled with NaN (as the KV cache manager
    may have handed them on): the AVX512-BF16/AMX kernels take every row, as the reference says."""
    kernels = _decode_kernels_or_skip(native_kernels)
    seqs = [(300, 1), (70, 1), (0, 150), (300, 40), (130, 64)]
    layout, slot_mapping, kv_cache, query, key, value = _random_batch(
        seqs, 16, 9, 3, 64, torch.bfloat16, seed=window, in_order=in_order
    )
    layer = LayerAttention(sliding_window=window)
    write_kv_reference(kv_cache, key, value, slot_mapping)
    expected = paged_attention_reference(query, kv_cache, layout, layer)
    for sequence in layout.sequences:
        first_needed = max(0, sequence.num_context_tokens - window + 1)
        kv_cache[:, sequence.block_table[: first_needed // 16]] = float("nan")
    calls = []
    for name in ("prefill_attention", "paged_decode_attention"):
        kernel = getattr(kernels.attention, name)
        monkeypatch.setattr(kernels.attention, name, _counted(kernel, name, calls))
    backend = CPUAttentionBackend(torch.device("cpu"), kernels, decode_as_prefill=decode_as_prefill)
    metadata = backend.build_metadata(layout, slot_mapping)
    output = backend.forward(query, key, value, kv_cache, metadata, layer)
    torch.testing.assert_close(output.float(), expected.float(), atol=2e-2, rtol=2e-2)
    assert calls.count("paged_decode_attention") == 1 and calls.count("prefill_attention") == 3


def _counted(kernel, name, calls):
    def counted(*args, **options):
        calls.append(name)
        return kernel(*args, **options)

    return counted
