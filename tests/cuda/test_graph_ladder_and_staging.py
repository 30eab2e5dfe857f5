"""Host-side logic of the CUDA path: the graph ladder, padding sizes, step arrays, staging."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from firsttoken.core.batch import SampleSpec, ScheduledChunk
from firsttoken.sampling_params import SamplingParams
from firsttoken.attention.triton_kernels import chunk_tiles
from firsttoken.worker.cuda_graphs import graph_batch_sizes, graph_token_sizes, max_chunk_tiles, padded_size
from firsttoken.attention.backend import SequenceLayout
from firsttoken.attention.staging import StagingBuffer
from firsttoken.worker.step_inputs import build_host_step


@pytest.mark.parametrize(
    "max_num_seqs,expected",
    [
        (1, [1]),
        (3, [1, 2, 3]),
        (16, [1, 2, 4, 8, 16]),
        (20, [1, 2, 4, 8, 16, 20]),
        (64, [1, 2, 4, 8, 16, 32, 48, 64]),
        (100, [1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 100]),
    ],
)
def test_graph_ladder(max_num_seqs, expected):
    assert graph_batch_sizes(max_num_seqs) == expected


def test_a_batch_pads_to_the_smallest_size_that_holds_it():
    sizes = graph_batch_sizes(64)
    assert [padded_size(n, sizes) for n in (1, 2, 3, 5, 8, 9, 16, 17, 33, 64)] == [
        1,
        2,
        4,
        8,
        8,
        16,
        16,
        32,
        48,
        64,
    ]
    assert padded_size(65, sizes) is None


@pytest.mark.parametrize(
    "max_tokens,expected",
    [
        (1, [1]),
        (16, [16]),
        (40, [16, 32, 40]),
        (200, [16, 32, 48, 64, 96, 128, 192, 200]),
        (
            2048,
            [
                16,
                32,
                48,
                64,
                96,
                128,
                192,
                256,
                320,
                384,
                448,
                512,
                640,
                768,
                896,
                1024,
                1280,
                1536,
                1792,
                2048,
            ],
        ),
    ],
)
def test_token_ladder(max_tokens, expected):
    assert graph_token_sizes(max_tokens) == expected


@pytest.mark.parametrize("tile_tokens", [1, 7, 21, 64])
def test_the_tile_table_holds_every_split_of_a_step(tile_tokens):
    """No split of up to `num_tokens` tokens over up to `max_num_seqs` sequences needs more tiles
    than the graph's table holds, and some split needs exactly that many."""
    rng = np.random.default_rng(tile_tokens)
    max_num_seqs = 8
    for num_tokens in (1, 5, 16, 64, 100, 512):
        bound = max_chunk_tiles(num_tokens, max_num_seqs, tile_tokens)
        most = 0
        for _ in range(200):
            num_seqs = int(rng.integers(1, min(num_tokens, max_num_seqs) + 1))
            cuts = np.sort(rng.choice(np.arange(1, num_tokens), size=num_seqs - 1, replace=False))
            lengths = np.diff(np.concatenate([[0], cuts, [num_tokens]]))
            most = max(most, len(chunk_tiles([(0, 0, int(n)) for n in lengths], tile_tokens)))
        # The worst split: all but one sequence one tile past a multiple of tile_tokens.
        num_seqs = min(num_tokens, max_num_seqs)
        worst = [tile_tokens + 1] * (num_seqs - 1)
        if sum(worst) < num_tokens:
            worst.append(num_tokens - sum(worst))
            most = max(most, len(chunk_tiles([(0, 0, n) for n in worst], tile_tokens)))
        assert most <= bound


def _chunk(req_id, token_ids, start, table, samples=True):
    spec = SampleSpec(SamplingParams(temperature=0, max_tokens=4), 0, req_id) if samples else None
    return ScheduledChunk(req_id, token_ids, start, table, spec)


def _plain_step_inputs(chunks, block_size):
    """Per token, in batch order (one-token chunks first): id, position, slot; the sampling rows."""
    ordered = [c for c in chunks if c.num_tokens == 1] + [c for c in chunks if c.num_tokens > 1]
    input_ids, positions, slots, sample_rows = [], [], [], []
    for chunk in ordered:
        for offset, token_id in enumerate(chunk.token_ids):
            position = chunk.start_position + offset
            input_ids.append(token_id)
            positions.append(position)
            slots.append(chunk.block_table[position // block_size] * block_size + position % block_size)
        if chunk.sample is not None:
            sample_rows.append(len(input_ids) - 1)
    layout = [SequenceLayout(c.num_tokens, c.start_position, c.block_table) for c in ordered]
    return input_ids, positions, slots, sample_rows, layout


@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
def test_host_step_matches_the_plain_per_token_inputs(index_dtype):
    chunks = [
        _chunk("prefill", list(range(40, 50)), 3, [7, 2, 9, 4], samples=False),
        _chunk("decode-a", [5], 6, [1, 8]),
        _chunk("decode-b", [6], 0, [3]),
        _chunk("prompt", list(range(60, 65)), 0, [11, 12]),
    ]
    step = build_host_step(chunks, block_size=4, index_dtype=index_dtype)
    input_ids, positions, slots, sample_rows, sequences = _plain_step_inputs(chunks, 4)
    assert step.input_ids.dtype == index_dtype
    assert step.input_ids.tolist() == input_ids
    assert step.positions.tolist() == positions
    assert step.slot_mapping.tolist() == slots
    assert step.sample_rows.tolist() == sample_rows == [0, 1, 16]
    assert step.layout.sequences == sequences and step.layout.num_decodes == 2
    assert not step.is_decode_only and not step.samples_every_row


def test_staging_packs_arrays_and_grows():
    staging = StagingBuffer(torch.device("cpu"), torch.int32, capacity=8)
    a, b = np.arange(6, dtype=np.int32), np.arange(12, dtype=np.int32).reshape(3, 4)
    staged_a, staged_b = staging.stage([a, b])
    assert staging.capacity >= 18
    assert staged_a.tolist() == a.tolist() and staged_b.tolist() == b.tolist()
    (staged_c,) = staging.stage([np.array([9, 8], dtype=np.int32)])
    assert staged_c.tolist() == [9, 8]
