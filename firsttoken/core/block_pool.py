"""BlockPool: every KV block's reference count, the free list in LRU order and the hash -> block map.

A block with no references sits in the free list. If it still holds a cached prefix (it has a
hash) it can be revived by a request with the same prefix until an allocation evicts it;
allocations take the least recently freed block first.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable

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
        # Head is evicted first: the least recently freed block.
        self._free: OrderedDict[int, KVBlock] = OrderedDict((block.block_id, block) for block in self.blocks)
        self._cached: dict[BlockHash, KVBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by a request or a pin."""
        return 1.0 - len(self._free) / self.num_blocks

    def free_block_ids_in_eviction_order(self) -> list[int]:
        return list(self._free)

    def cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        return self._cached.get(block_hash) if self.enable_caching else None

    def allocate(self, num_blocks: int) -> list[KVBlock] | None:
        """`num_blocks` fresh blocks (evicting their old prefixes), or None if too few are free."""
        if num_blocks > len(self._free):
            return None
        allocated = []
        for _ in range(num_blocks):
            _, block = self._free.popitem(last=False)
            self._forget_hash(block)
            block.ref_cnt = 1
            allocated.append(block)
        return allocated

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on cached blocks; a free one is revived out of the free list."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def release(self, blocks: Iterable[KVBlock]) -> None:
        """Drop a reference; blocks reaching zero join the free list's tail in the given order."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {block.block_id} released more often than taken")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

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

    def _forget_hash(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
            block.block_hash = None
