"""The sharding math of tensor parallelism, one rank at a time in this process: which heads and
rows a rank holds, and that the ranks' slices add up to the full layers."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from firsttoken.errors import InvalidInputError
from firsttoken.models.arch import ModelArch
from firsttoken.models.llama import LlamaMLP
from firsttoken.models.sharding import (
    balanced_ranges,
    gather_vocab_logits,
    head_ranges,
    shard_for_rank,
    vocab_parallel_embedding,
)
from firsttoken.ops.kernels import Kernels
from firsttoken.ops.w8a8 import Int8Weight

ARCH = ModelArch(
    architecture="llama", vocab_size=101, hidden_size=32, intermediate_size=96, num_layers=1, num_heads=6,
    num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=64,
    tie_word_embeddings=True, attention_bias=False,
)


class OneRank:
    """One rank's collectives, run alone: its all-reduce leaves its partial sum (the test adds
    the ranks' up), its gather hands back what the test says the ranks sent."""

    def __init__(self, rank: int, world_size: int, gathered: list[torch.Tensor] | None = None) -> None:
        self.rank, self.world_size, self.gathered = rank, world_size, gathered

    def all_reduce(self, tensor: torch.Tensor) -> None:
        pass

    def gather_to_driver(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        return self.gathered


def test_balanced_ranges_cover_the_total_in_sizes_one_unit_apart():
    assert balanced_ranges(9, 2) == [(0, 5), (5, 9)]
    assert balanced_ranges(1536, 2, unit=64) == [(0, 768), (768, 1536)]
    assert balanced_ranges(192, 2, unit=64) == [(0, 128), (128, 192)]


@pytest.mark.parametrize(
    "num_heads, num_kv_heads, world_size",
    [(9, 3, 2), (9, 3, 3), (4, 2, 3), (4, 1, 4), (6, 2, 5), (32, 8, 8), (32, 8, 3)],
)
def test_each_query_head_is_on_exactly_one_rank_with_the_kv_head_it_reads(
    num_heads, num_kv_heads, world_size
):
    ranges = head_ranges(num_heads, num_kv_heads, world_size)
    assert len(ranges) == world_size
    group = num_heads // num_kv_heads
    covered = []
    for (q_start, q_end), (kv_start, kv_end) in ranges:
        assert q_end > q_start and kv_end > kv_start
        covered.extend(range(q_start, q_end))
        assert all(kv_start <= head // group < kv_end for head in range(q_start, q_end))
    assert covered == list(range(num_heads))


def test_more_ranks_than_kv_heads_replicate_a_kv_head():
    # 4 query heads on 2 KV heads over 3 ranks: ranks 0 and 1 share KV head 0.
    assert head_ranges(4, 2, 3) == [((0, 1), (0, 1)), ((1, 2), (0, 1)), ((2, 4), (1, 2))]


def test_more_ranks_than_query_heads_is_a_clear_error():
    with pytest.raises(
        InvalidInputError, match="tensor_parallel_size: 5 ranks exceed the model's 4 attention heads"
    ):
        head_ranges(4, 2, 5)


def test_kv_shares_add_up_to_the_whole_cache():
    shards = [shard_for_rank(ARCH, rank, 3) for rank in range(3)]
    assert sum(shard.kv_share for shard in shards) == pytest.approx(1.0)
    assert [shard.intermediate_range for shard in shards] == [
        (0, 32),
        (32, 64),
        (64, 96),
    ]  # 96: not whole 64s


def _mlp(world_size: int = 1, rank: int = 0, arch: ModelArch = ARCH) -> LlamaMLP:
    torch.manual_seed(0)
    mlp = LlamaMLP(arch, Kernels(fused=False), torch.float64)
    for parameter in mlp.parameters():
        parameter.data.normal_()
    if world_size > 1:
        mlp.shard(shard_for_rank(arch, rank, world_size), arch, OneRank(rank, world_size))
    return mlp


@pytest.mark.parametrize("mlp_bias", [False, True], ids=["no-bias", "mlp-bias"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_column_then_row_parallel_mlp_slices_add_up_to_the_full_mlp(world_size, mlp_bias):
    """down_proj's bias is added by one rank only: the sum holds it once."""
    arch = dataclasses.replace(ARCH, mlp_bias=mlp_bias)
    x = torch.randn(5, ARCH.hidden_size, dtype=torch.float64)
    partials = [_mlp(world_size, rank, arch)(x) for rank in range(world_size)]
    torch.testing.assert_close(sum(partials), _mlp(arch=arch)(x))


def _mlp_of_int8_levels() -> LlamaMLP:
    """An MLP whose projections hold a W8A8 checkpoint's levels and scales, their float weights
    the dequantized form."""
    mlp = _mlp()
    generator = torch.Generator().manual_seed(1)
    for linear in (mlp.gate_up_proj, mlp.down_proj):
        out_features, in_features = linear.weight.shape
        levels = torch.randint(-127, 128, (out_features, in_features), dtype=torch.int8, generator=generator)
        linear.checkpoint_int8 = Int8Weight(levels, torch.rand(out_features, generator=generator) + 0.5)
        linear.weight.data = linear.checkpoint_int8.dequantized().double()
    return mlp


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_w8a8_checkpoints_levels_are_sliced_with_their_projections(world_size):
    """Each rank keeps the levels of the rows (column-parallel) or columns (row-parallel, every
    scale kept) its float weight holds: they stay its dequantized form."""
    full = _mlp_of_int8_levels()
    down_levels = []
    for rank in range(world_size):
        mlp = _mlp_of_int8_levels()
        mlp.shard(shard_for_rank(ARCH, rank, world_size), ARCH, OneRank(rank, world_size))
        for linear in (mlp.gate_up_proj, mlp.down_proj.linear):
            torch.testing.assert_close(linear.checkpoint_int8.dequantized().double(), linear.weight.data)
        down = mlp.down_proj.linear.checkpoint_int8
        assert torch.equal(down.scales, full.down_proj.checkpoint_int8.scales)
        down_levels.append(down.levels)
    assert torch.equal(torch.cat(down_levels, dim=1), full.down_proj.checkpoint_int8.levels)


def test_vocab_parallel_embedding_slices_add_up_to_the_full_lookup():
    table = torch.randn(ARCH.vocab_size, ARCH.hidden_size)
    input_ids = torch.tensor([0, 50, 51, 100, 7])
    partials = []
    for rank in range(2):
        shard = shard_for_rank(ARCH, rank, 2)
        start, end = shard.vocab_range
        partials.append(vocab_parallel_embedding(input_ids, table[start:end], (start, end), OneRank(rank, 2)))
    torch.testing.assert_close(sum(partials), table[input_ids], atol=0, rtol=0)


def test_uneven_vocab_slices_gather_into_the_full_logits_on_rank_0_only():
    logits = torch.randn(3, ARCH.vocab_size)
    shards = [shard_for_rank(ARCH, rank, 2) for rank in range(2)]
    assert [shard.vocab_range for shard in shards] == [(0, 51), (51, 101)]
    padded = [
        torch.nn.functional.pad(logits[:, start:end], (0, 51 - (end - start)))
        for start, end in shards[0].vocab_ranges
    ]
    full = gather_vocab_logits(logits[:, :51], shards[0], OneRank(0, 2, gathered=padded))
    torch.testing.assert_close(full, logits, atol=0, rtol=0)
    assert gather_vocab_logits(logits[:, 51:], shards[1], OneRank(1, 2)) is None


def test_a_rank_keeps_its_heads_in_its_attention_arch():
    shard = shard_for_rank(dataclasses.replace(ARCH, num_heads=9, num_kv_heads=3), 1, 2)
    assert (shard.head_range, shard.kv_head_range) == ((6, 9), (2, 3))
    assert (shard.attention_arch(ARCH).num_heads, shard.attention_arch(ARCH).num_kv_heads) == (3, 1)
