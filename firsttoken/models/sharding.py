"""Megatron-style tensor parallelism of a Llama-family model: which slice of each weight a rank
holds, and the modules that join the slices back together.

Q/K/V and gate/up are split by output rows (column-parallel: each rank computes its own heads
and its own part of the MLP, no communication); the output and down projections are split by
input columns (row-parallel: each rank's product is a partial sum, added up by one all-reduce);
the embedding and the LM head are split by vocabulary rows. A rank holds whole query heads with
the KV heads they read: KV heads are divided among the ranks, and where there are more ranks
than KV heads, each rank holds one KV head (a copy of it on every rank that shares it) and a
share of its query heads. Splits need not be even: 9 query heads over 2 ranks are 6 and 3.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from firsttoken.errors import InvalidInputError
from firsttoken.models.arch import ModelArch

# Intermediate slices in whole multiples of this, where they can be: the native int4 and int8
# decode kernels take inputs of whole 64-element groups (a row-parallel down projection's input).
_INTERMEDIATE_UNIT = 64

Range = tuple[int, int]  # [start, end)


class Collectives(Protocol):
    """What a sharded model needs of its process group."""

    rank: int
    world_size: int

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum `tensor` over the ranks, in place."""

    def gather_to_driver(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's `tensor` (equal shapes) on rank 0, in rank order; None on the others."""


@dataclass(frozen=True)
class ModelShard:
    """The slices of a model one rank holds, and the vocabulary slices of every rank (rank 0
    reassembles logits from them)."""

    rank: int
    world_size: int
    head_range: Range  # query heads
    kv_head_range: Range
    intermediate_range: Range
    vocab_ranges: tuple[Range, ...]  # every rank's, in rank order
    num_stored_kv_heads: int  # over all ranks, copies included

    @property
    def kv_share(self) -> float:
        """This rank's part of the engine's KV cache (of a memory budget the ranks share)."""
        return self.num_kv_heads / self.num_stored_kv_heads

    @property
    def num_heads(self) -> int:
        return self.head_range[1] - self.head_range[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_head_range[1] - self.kv_head_range[0]

    @property
    def vocab_range(self) -> Range:
        return self.vocab_ranges[self.rank]

    @property
    def max_vocab_slice(self) -> int:
        """The largest rank's vocabulary slice: every rank's logits are padded to it to be gathered."""
        return max(end - start for start, end in self.vocab_ranges)

    def attention_arch(self, arch: ModelArch) -> ModelArch:
        """`arch` with this rank's head counts: what its attention and KV cache are sized by."""
        return dataclasses.replace(arch, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads)


def balanced_ranges(total: int, parts: int, unit: int = 1) -> list[Range]:
    """`total` split into `parts` contiguous ranges whose sizes (in whole `unit`s, which must
    divide `total`) differ by at most one unit, larger ones first."""
    num_units = total // unit
    base, extra = divmod(num_units, parts)
    ranges, start = [], 0
    for part in range(parts):
        size = (base + (part < extra)) * unit
        ranges.append((start, start + size))
        start += size
    return ranges


def head_ranges(num_heads: int, num_kv_heads: int, world_size: int) -> list[tuple[Range, Range]]:
    """Each rank's (query heads, KV heads). Raises InvalidInputError when a rank would get no
    query head."""
    if world_size > num_heads:
        raise InvalidInputError(
            "tensor_parallel_size",
            f"{world_size} ranks exceed the model's {num_heads} attention heads (each rank needs at least "
            "one)",
        )
    group = num_heads // num_kv_heads  # query heads per KV head
    if world_size <= num_kv_heads:
        return [
            ((start * group, end * group), (start, end))
            for start, end in balanced_ranges(num_kv_heads, world_size)
        ]
    # More ranks than KV heads: the ranks sharing KV head k split its group of query heads.
    # A KV head gets at most ceil(world_size / num_kv_heads) <= group ranks, so none goes without.
    ranges = []
    for kv_head, (first_rank, end_rank) in enumerate(balanced_ranges(world_size, num_kv_heads)):
        for start, end in balanced_ranges(group, end_rank - first_rank):
            ranges.append(((kv_head * group + start, kv_head * group + end), (kv_head, kv_head + 1)))
    return ranges


def shard_for_rank(arch: ModelArch, rank: int, world_size: int) -> ModelShard:
    """What rank `rank` of `world_size` holds; raises InvalidInputError for a split that cannot be."""
    if world_size > arch.vocab_size or world_size > arch.intermediate_size:
        raise InvalidInputError("tensor_parallel_size", f"{world_size} ranks exceed the model's sizes")
    ranges = head_ranges(arch.num_heads, arch.num_kv_heads, world_size)
    heads, kv_heads = ranges[rank]
    units_divide = arch.intermediate_size % _INTERMEDIATE_UNIT == 0
    unit = (
        _INTERMEDIATE_UNIT
        if units_divide and arch.intermediate_size // _INTERMEDIATE_UNIT >= world_size
        else 1
    )
    return ModelShard(
        rank=rank,
        world_size=world_size,
        head_range=heads,
        kv_head_range=kv_heads,
        intermediate_range=balanced_ranges(arch.intermediate_size, world_size, unit)[rank],
        vocab_ranges=tuple(balanced_ranges(arch.vocab_size, world_size)),
        num_stored_kv_heads=sum(end - start for _, (start, end) in ranges),
    )


def qkv_rows(shard: ModelShard, arch: ModelArch) -> torch.Tensor:
    """Rows of the fused [q; k; v] projection this rank computes: its query heads, then its KV heads'
    keys and values."""
    head_dim, q_size, kv_size = arch.head_dim, arch.q_size, arch.kv_size
    (q_start, q_end), (kv_start, kv_end) = shard.head_range, shard.kv_head_range
    return torch.cat([
        torch.arange(q_start * head_dim, q_end * head_dim),
        torch.arange(q_size + kv_start * head_dim, q_size + kv_end * head_dim),
        torch.arange(q_size + kv_size + kv_start * head_dim, q_size + kv_size + kv_end * head_dim),
    ])


def gate_up_rows(shard: ModelShard, arch: ModelArch) -> torch.Tensor:
    """Rows of the fused [gate; up] projection this rank computes: its slice of each."""
    start, end = shard.intermediate_range
    return torch.cat(
        [torch.arange(start, end), torch.arange(arch.intermediate_size + start, arch.intermediate_size + end)]
    )


class RowParallelLinear(nn.Module):
    """A projection holding a slice of the input features: its product is this rank's partial
    sum of the full one, added up over the ranks by one all-reduce. `linear` may be converted
    into any faster or quantized form; the sum stays outside it."""

    def __init__(self, linear: nn.Module, collectives: Collectives) -> None:
        super().__init__()
        self.linear = linear
        self.collectives = collectives

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = self.linear(x)
        self.collectives.all_reduce(partial)
        return partial


def vocab_parallel_embedding(
    input_ids: torch.Tensor, embed_slice: torch.Tensor, vocab_range: Range, collectives: Collectives
) -> torch.Tensor:
    """[T, hidden] embeddings from each rank's slice of the table: a rank looks up the ids in
    its slice, zeros elsewhere, and the all-reduce adds exactly one non-zero row per token."""
    start, end = vocab_range
    outside = (input_ids < start) | (input_ids >= end)
    local_ids = (input_ids - start).masked_fill(outside, 0)
    hidden = nn.functional.embedding(local_ids, embed_slice)
    hidden.masked_fill_(outside.unsqueeze(-1), 0)
    collectives.all_reduce(hidden)
    return hidden


def gather_vocab_logits(
    local_logits: torch.Tensor, shard: ModelShard, collectives: Collectives
) -> torch.Tensor | None:
    """Rank 0: the full [R, vocab] logits from every rank's [R, slice]; None on the other ranks."""
    padding = shard.max_vocab_slice - local_logits.shape[-1]
    padded = nn.functional.pad(local_logits, (0, padding)) if padding else local_logits.contiguous()
    gathered = collectives.gather_to_driver(padded)
    if gathered is None:
        return None
    return torch.cat(
        [logits[:, : end - start] for logits, (start, end) in zip(gathered, shard.vocab_ranges)], dim=-1
    )
