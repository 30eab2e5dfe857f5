"""The Triton paged kernel's sliding windows, soft-capped scores and StreamingLLM sinks against the
plain reference, the bits a row keeps wherever it is computed, and the blocks it never reads.

Without a GPU they run under the Triton interpreter (see tests/cuda/triton_interpreter.py).
"""

from __future__ import annotations

import pytest
import torch

from firsttoken.attention.backend import LayerAttention
from firsttoken.attention.cuda_backend import CudaAttentionBackend
from firsttoken.attention.reference import paged_attention_reference, window_starts
from firsttoken.attention.triton_kernels import (
    KEYS_PER_TILE,
    ChunkQueries,
    DecodeQueries,
    check_layer_attention,
    chunk_tiles,
    paged_chunk_attention,
    paged_decode_attention,
    prefill_tile_shape,
    store_kv,
)
from tests.cuda.paged_inputs import random_paged_inputs
from tests.cuda.triton_interpreter import SLOW_ON_CPU

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
# Scores of random unit-variance queries and keys are ~N(0, 1): a cap of 2 bends them visibly.
LAYERS = {
    "window": LayerAttention(sliding_window=16),
    "softcap": LayerAttention(logit_softcap=2.0),
    "window-softcap": LayerAttention(sliding_window=40, logit_softcap=2.0),
    "sinks": LayerAttention(sliding_window=16, sink_tokens=4),
    "one-sink-softcap": LayerAttention(sliding_window=5, logit_softcap=2.0, sink_tokens=1),
}
# Decodes, then prefills: fresh, on a mid-block prefix, and on a context longer than a key tile.
SEQUENCES = [(30, 1), (100, 1), (3, 1), (0, 37), (17, 45), (90, 70)]
NUM_DECODES = 3


def _mixed_step(layer: LayerAttention, dtype: torch.dtype, device: torch.device, block_size: int = 16):
    """The backend's output for a step of decodes and paged prefills, and the reference's."""
    inputs = random_paged_inputs(SEQUENCES, NUM_DECODES, block_size, 9, 3, 64, dtype, device)
    sink_query = torch.randn(inputs.query.shape, generator=torch.Generator().manual_seed(7)).to(dtype)
    sink_query = sink_query.to(device) if layer.sink_tokens else None
    backend = CudaAttentionBackend(device, 9, 3, paged_prefills=True)
    metadata = backend.build_metadata(inputs.layout, inputs.slot_mapping)
    output = backend.forward(
        inputs.query, inputs.key, inputs.value, inputs.kv_cache, metadata, layer, sink_query
    )
    expected = paged_attention_reference(
        inputs.query.cpu(),
        inputs.kv_cache.cpu(),
        inputs.layout,
        layer,
        None if sink_query is None else sink_query.cpu(),
    )
    return output.cpu().float(), expected.float()


# Under the interpreter the combined kinds by default: each option alone is the slow tier's.
@pytest.mark.parametrize(
    "name",
    [pytest.param(name, marks=SLOW_ON_CPU) for name in ("window", "softcap", "sinks")]
    + ["window-softcap", "one-sink-softcap"],
)
def test_each_layer_kind_matches_the_reference_on_a_mixed_step(device, name):
    output, expected = _mixed_step(LAYERS[name], torch.float32, device)
    torch.testing.assert_close(output, expected, atol=2e-5, rtol=2e-5)
    # The option changes the result: the comparison would see a kernel that ignored it.
    _, plain = _mixed_step(LayerAttention(), torch.float32, device)
    assert not torch.allclose(expected, plain, atol=1e-3, rtol=1e-3)


def test_a_bfloat16_layer_with_a_window_soft_cap_and_sinks_matches_the_reference(device):
    layer = LayerAttention(sliding_window=24, logit_softcap=2.0, sink_tokens=4)
    output, expected = _mixed_step(layer, torch.bfloat16, device)
    torch.testing.assert_close(output, expected, atol=2e-2, rtol=2e-2)


def test_reference_window_starts_keep_the_sinks_until_the_window_leaves_them():
    positions = torch.tensor([0, 15, 19, 20, 21, 40])
    window = LayerAttention(sliding_window=16)
    assert window_starts(positions, window).tolist() == [0, 0, 4, 5, 6, 25]
    sinks = LayerAttention(sliding_window=16, sink_tokens=4)
    assert window_starts(positions, sinks).tolist() == [0, 0, 0, 5, 6, 25]


def _one_sequence(block_size: int, context: int, num_new: int, device: torch.device):
    inputs = random_paged_inputs([(context, num_new)], 0, block_size, 9, 3, 64, torch.bfloat16, device)
    store_kv(inputs.kv_cache, inputs.key, inputs.value, inputs.slot_mapping)
    block_table = torch.tensor(inputs.layout.sequences[0].block_table, dtype=torch.int32, device=device)
    return inputs, block_table[None, :]


def _as_chunks(inputs, block_tables, context, cuts, layer, sink_query) -> torch.Tensor:
    """The rows computed as the chunks [cuts[i], cuts[i + 1]) of the new tokens, a launch each."""
    output = torch.full_like(inputs.query, float("nan"))
    for start, end in zip(cuts, cuts[1:]):
        tiles = chunk_tiles([(start, context + start, end - start)], prefill_tile_shape(3).query_tokens)
        tiles = torch.tensor(tiles, dtype=torch.int32, device=block_tables.device)
        queries = ChunkQueries(block_tables, tiles)
        paged_chunk_attention(output, inputs.query, inputs.kv_cache, queries, layer, sink_query)
    return output


@pytest.mark.parametrize("name", ["window-softcap", "sinks"])
def test_a_rows_bits_are_the_same_in_any_chunk_and_as_a_decode(device, name):
    """bf16 rows of one sequence (70 cached tokens, 60 new): as one chunk, as chunks cut
    elsewhere, and as decodes on the chunk kernel's tiles, whose windows start in other tiles."""
    layer = LAYERS[name]
    context, num_new = 70, 60
    inputs, block_tables = _one_sequence(16, context, num_new, device)
    sink_query = (inputs.query * 0.5 + 0.25).contiguous() if layer.sink_tokens else None
    whole = _as_chunks(inputs, block_tables, context, [0, num_new], layer, sink_query)
    for cuts in ([0, 1, 17, num_new], [0, 29, 30, 59, num_new]):
        assert torch.equal(_as_chunks(inputs, block_tables, context, cuts, layer, sink_query), whole), cuts
    for row in (0, 21, 45, num_new - 1):
        decoded = torch.full_like(inputs.query[row : row + 1], float("nan"))
        seq_lens = torch.tensor([context + row + 1], dtype=torch.int32, device=device)
        paged_decode_attention(
            decoded,
            inputs.query[row : row + 1],
            inputs.kv_cache,
            DecodeQueries(block_tables, seq_lens),
            as_chunk_tiles=True,
            layer=layer,
            sink_query=None if sink_query is None else sink_query[row : row + 1],
        )
        assert torch.equal(decoded[0], whole[row]), row


@pytest.mark.parametrize("name", ["window", "sinks"])
def test_blocks_before_the_first_rows_window_are_never_read(device, name):
    """The blocks wholly before the window of a chunk's first row (sinks apart) may be back in the
    pool, holding anything: NaN there leaves every row's output as it was."""
    layer = LAYERS[name]
    block_size, context, num_new = 8, 200, 30
    inputs, block_tables = _one_sequence(block_size, context, num_new, device)
    sink_query = inputs.query.contiguous() if layer.sink_tokens else None
    cuts = [0, num_new]
    clean = _as_chunks(inputs, block_tables, context, cuts, layer, sink_query)
    first_key = context - layer.sliding_window + 1
    sink_blocks = -(-layer.sink_tokens // block_size)
    released = inputs.layout.sequences[0].block_table[sink_blocks : first_key // block_size]
    assert len(released) > KEYS_PER_TILE // block_size  # whole key tiles, and a partial one
    inputs.kv_cache[:, released] = float("nan")
    block_table = inputs.layout.sequences[0].block_table
    for position in range(first_key // block_size * block_size, first_key):  # its first block's head
        inputs.kv_cache[:, block_table[position // block_size], position % block_size] = float("nan")
    assert torch.equal(_as_chunks(inputs, block_tables, context, cuts, layer, sink_query), clean)


def test_layers_the_kernel_cannot_attend_are_refused_by_name(device):
    with pytest.raises(ValueError, match="sink_tokens"):
        check_layer_attention(LayerAttention(sliding_window=100, sink_tokens=KEYS_PER_TILE + 1))
    with pytest.raises(ValueError, match="sink_tokens"):
        check_layer_attention(LayerAttention(sink_tokens=4))
    inputs = random_paged_inputs([(0, 9)], 0, 4, 4, 2, 16, torch.float32, device)
    backend = CudaAttentionBackend(device, 4, 2)
    metadata = backend.build_metadata(inputs.layout, inputs.slot_mapping)
    # Without paged prefills a fresh prompt goes to SDPA, which has no window.
    with pytest.raises(ValueError, match="paged_prefills"):
        backend.forward(
            inputs.query, inputs.key, inputs.value, inputs.kv_cache, metadata, LAYERS["window"]
        )
