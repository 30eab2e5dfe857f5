"""BlockPool: every KV block's reference count, the free lists and the hash -> block map.

A block with no references is free. If it still holds a cached prefix (it has a hash) it sits
in an LRU list and can be revived by a request with the same prefix until an allocation evicts
it, least recently freed first. A free block without a hash holds nothing worth keeping: such
blocks are handed out before any cached one, most recently freed first, because its memory is
warm (and on the CPU, its pages are already mapped; a never-written page costs a fault).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from firsttoken.core.hashing import BlockHash


@dataclass(eq=False)
class KVBlock:
    """One block of the paged cache: its id, who references it and which prefix it holds."""

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None


class BlockPool:
    """Owns all blocks; hands them out, takes them back, and keeps the prefix-cache index."""

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks: must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(block_id) for block_id in range(num_blocks)]
        # Free blocks without a hash, popped from the end: block 0 is handed out first.
        self._free_uncached: list[KVBlock] = self.blocks[::-1]
        # Free blocks holding a cached prefix; the head is evicted first.
        self._free_cached: OrderedDict[int, KVBlock] = OrderedDict()
        self._cached: dict[BlockHash, KVBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_uncached) + len(self._free_cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by a request or a pin."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def free_block_ids_in_eviction_order(self) -> list[int]:
        uncached = [block.block_id for block in reversed(self._free_uncached)]
        return uncached + list(self._free_cached)

    def cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        return self._cached.get(block_hash) if self.enable_caching else None

    def allocate(self, num_blocks: int) -> list[KVBlock] | None:
        """`num_blocks` blocks, evicting cached prefixes only when no empty block is left,
        or None if too few are free."""
        if num_blocks > self.num_free_blocks:
            return None
        allocated = []
        for _ in range(num_blocks):
            if self._free_uncached:
                block = self._free_uncached.pop()
            else:
                _, block = self._free_cached.popitem(last=False)
                self._forget_hash(block)
            block.ref_cnt = 1
            allocated.append(block)
        # Ascending ids: a sequence's blocks are then often one run of the cache, which
        # attention reads in place instead of gathering (eviction hands out tails first).
        allocated.sort(key=lambda block: block.block_id)
        return allocated

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on cached blocks; a free one is revived out of the free list."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free_cached[block.block_id]
            block.ref_cnt += 1

    def release(self, blocks: Iterable[KVBlock]) -> None:
        """Drop a reference; cached blocks reaching zero join the LRU tail in the given order."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {block.block_id} released more often than taken")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._add_free(block)

    def cache(self, block: KVBlock, block_hash: BlockHash) -> None:
        """Record that `block` holds the prefix `block_hash` (the first holder of a prefix wins)."""
        if not self.enable_caching or block.block_hash is not None or block_hash in self._cached:
            return
        block.block_hash = block_hash
        self._cached[block_hash] = block

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix; blocks in use stay allocated but are no longer shared."""
        for block in self.blocks:
            block.block_hash = None
        self._cached.clear()
        while self._free_cached:
            _, block = self._free_cached.popitem(last=False)
            self._free_uncached.append(block)

    def _add_free(self, block: KVBlock) -> None:
        if block.block_hash is None:
            self._free_uncached.append(block)
        else:
            self._free_cached[block.block_id] = block

    def _forget_hash(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
            block.block_hash = None
