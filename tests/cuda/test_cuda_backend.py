"""The CUDA attention backend against the plain reference on a mixed step: decodes, fresh
prefills and chunks on cached context, with shuffled block tables."""

from __future__ import annotations

import pytest
import torch

from firsttoken.attention.cuda_backend import CudaAttentionBackend
from firsttoken.attention.reference import paged_attention_reference, write_kv_reference
from firsttoken.attention.cpu_backend import CPUAttentionBackend
from firsttoken.attention.selector import select_attention_backend
from firsttoken.config import AttentionConfig
from tests.cuda.paged_inputs import random_paged_inputs
from tests.cuda.tiny_engine import TINY_ARCH

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("paged_prefills", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", [(9, 3, 64, 16), (4, 4, 32, 5)])
def test_cuda_backend_matches_reference_on_a_mixed_step(
    device, dtype, num_heads, num_kv_heads, head_dim, block_size, paged_prefills
):
    seqs = [
        (30, 1),  # decodes
        (block_size - 1, 1),
        (0, 1),  # a one-token prompt
        (0, 37),  # a fresh prefill: SDPA, or the chunk kernel when paged_prefills
        (block_size * 3, 21),  # chunks on cached context: the Triton chunk kernel
        (0, 2),
        (17, 45),
    ]
    inputs = random_paged_inputs(seqs, 3, block_size, num_heads, num_kv_heads, head_dim, dtype, device)
    expected_cache = inputs.kv_cache.cpu().clone()
    write_kv_reference(expected_cache, inputs.key.cpu(), inputs.value.cpu(), inputs.slot_mapping.cpu())

    backend = CudaAttentionBackend(device, num_heads, num_kv_heads, paged_prefills)
    metadata = backend.build_metadata(inputs.layout, inputs.slot_mapping)
    assert (metadata.fresh_prefills == []) == paged_prefills
    output = backend.forward(inputs.query, inputs.key, inputs.value, inputs.kv_cache, metadata)

    assert torch.equal(inputs.kv_cache.cpu(), expected_cache)
    expected = paged_attention_reference(inputs.query.cpu(), expected_cache, inputs.layout)
    torch.testing.assert_close(
        output.cpu().float(), expected.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype]
    )


def test_metadata_routes_each_sequence_to_its_kernel(device):
    inputs = random_paged_inputs(
        [(3, 1), (0, 1), (0, 9), (20, 5), (0, 4)], 2, 4, 4, 2, 16, torch.float32, device
    )
    metadata = CudaAttentionBackend(device, 4, 2).build_metadata(inputs.layout, inputs.slot_mapping)
    assert metadata.decodes.seq_lens.tolist() == [4, 1]
    assert [(p.first_row, p.num_tokens) for p in metadata.fresh_prefills] == [(2, 9), (16, 4)]
    # One chunk of 5 rows (a tile holds 32 query tokens of a group of 2) at row 11, position 20.
    assert metadata.chunks.tiles.tolist() == [[0, 11, 20, 5]]
    assert metadata.chunks.block_tables.shape == (1, 7)


def test_paged_prefills_send_every_prefill_through_the_chunk_kernel(device):
    inputs = random_paged_inputs([(3, 1), (0, 9), (20, 5), (0, 40)], 1, 4, 4, 2, 16, torch.float32, device)
    metadata = CudaAttentionBackend(device, 4, 2, paged_prefills=True).build_metadata(
        inputs.layout, inputs.slot_mapping
    )
    assert metadata.fresh_prefills == []
    assert metadata.decodes.seq_lens.tolist() == [4]
    # Tiles of 32 query tokens: the 40-token prompt takes two.
    assert metadata.chunks.tiles.tolist() == [[0, 1, 0, 9], [1, 10, 20, 5], [2, 15, 0, 32], [2, 47, 32, 8]]


def test_selector_picks_by_device_and_refuses_mismatches():
    heads = (TINY_ARCH.num_heads, TINY_ARCH.num_kv_heads)
    cpu_backend = select_attention_backend(AttentionConfig(), torch.device("cpu"), *heads)
    assert isinstance(cpu_backend, CPUAttentionBackend)
    with pytest.raises(ValueError, match="triton needs device cuda"):
        select_attention_backend(AttentionConfig(backend="triton"), torch.device("cpu"), *heads)
    with pytest.raises(ValueError, match="sdpa runs on the CPU"):
        select_attention_backend(AttentionConfig(backend="sdpa"), torch.device("cuda"), *heads)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="builds the CUDA backend's pinned staging buffer")
@pytest.mark.parametrize("batch_invariant", [False, True])
def test_batch_invariance_sends_every_row_through_the_chunk_kernels_tiles(batch_invariant):
    heads = (TINY_ARCH.num_heads, TINY_ARCH.num_kv_heads)
    backend = select_attention_backend(
        AttentionConfig(), torch.device("cuda"), *heads, batch_invariant=batch_invariant
    )
    assert backend.paged_prefills == backend.decodes_as_chunks == batch_invariant
