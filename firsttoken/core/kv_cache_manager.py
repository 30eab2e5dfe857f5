"""KVCacheManager: which blocks each request holds, prefix-cache lookups and pinned prefixes.

It hands out block ids and never touches tensors. Allocation failure is `False`/`None`, never
a partial allocation: a request either gets every block it asked for or nothing changes.

With a sliding window (every layer's query sees its last `sliding_window` keys), the blocks
wholly before the window of a request's next token are given back as it advances, so a long
sequence holds about window / block_size blocks; they keep their place in its block table
(attention never reads them) and, with prefix caching, their cached prefix until evicted. With
StreamingLLM's `sink_tokens`, the blocks holding those first tokens are kept. A prefix-cache hit
then needs only the blocks its next token attends to (the sinks and its window), so a long
conversation's next turn reuses its window's KV even once the blocks before it are evicted.
"""

from __future__ import annotations

from dataclasses import dataclass

from firsttoken.arithmetic import ceil_div
from firsttoken.core.block_pool import BlockPool, KVBlock
from firsttoken.core.hashing import BlockHash
from firsttoken.request import Request


# What a block table holds for a block a request never held (see KVCacheManager.block_ids).
WINDOW_GAP_BLOCK_ID = 0


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups in tokens, over the engine's life (vLLM's queries / hits)."""

    num_query_tokens: int = 0
    num_hit_tokens: int = 0


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    return ceil_div(num_tokens, block_size)


class KVCacheManager:
    """Maps requests to blocks; owns the block pool, the per-request block lists and the pins."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool,
        sliding_window: int | None = None,
        sink_tokens: int = 0,
    ) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.sliding_window = sliding_window
        self.num_sink_blocks = num_blocks_for(sink_tokens, block_size)
        self.pool = BlockPool(num_blocks, enable_caching)
        self.stats = PrefixCacheStats()
        self._blocks: dict[str, list[KVBlock]] = {}
        self._num_registered_blocks: dict[str, int] = {}
        # Each request has given back its blocks from the sink blocks up to this index (those its
        # window has passed).
        self._released_until: dict[str, int] = {}
        self._pins: dict[str, list[KVBlock]] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def max_blocks_held(self, num_tokens: int, max_step_tokens: int) -> int:
        """The most blocks a request of `num_tokens` tokens ever holds at once, taking at most
        `max_step_tokens` new tokens a step: all of them, or with a sliding window those of the
        window before a step plus the step's (one more where they straddle a block edge)."""
        num_blocks = num_blocks_for(num_tokens, self.block_size)
        if self.sliding_window is None:
            return num_blocks
        in_window = num_blocks_for(self.sliding_window - 1 + max_step_tokens, self.block_size) + 1
        return min(num_blocks, self.num_sink_blocks + in_window)

    def block_ids(self, req_id: str) -> list[int]:
        """The request's block table: a block past its window that it never held (a windowed
        prefix hit) reads as block 0, which no attention reads."""
        blocks = self._blocks.get(req_id, ())
        return [WINDOW_GAP_BLOCK_ID if block is None else block.block_id for block in blocks]

    def find_cached_prefix(self, request: Request) -> list[KVBlock | None]:
        """The longest cached prefix of the request's tokens: a run of cached blocks from its
        start, or with a sliding window only the blocks its next token still attends to (the
        sinks and the window; None for the blocks between, which need not be cached).

        The last token is always left to compute, since its logits give the next token.
        """
        if not self.enable_caching:
            return []
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        cached = [self.pool.cached_block(block_hash) for block_hash in request.block_hashes[:max_hit_blocks]]
        if self.sliding_window is None:
            return cached[: cached.index(None)] if None in cached else cached
        return self._windowed_hit(cached)

    def _windowed_hit(self, cached: list[KVBlock | None]) -> list[KVBlock | None]:
        """The most leading blocks whose sinks and whose last window (that of the token after
        them) are all cached, with None for the blocks between the two."""
        num_leading_sinks = next(
            (index for index, block in enumerate(cached[: self.num_sink_blocks]) if block is None),
            min(self.num_sink_blocks, len(cached)),
        )
        last_missing = -1
        last_missing_before = []  # [k]: the last uncached block index below k, -1 if none
        for index, block in enumerate(cached):
            last_missing_before.append(last_missing)
            if block is None:
                last_missing = index
        last_missing_before.append(last_missing)
        for num_hit_blocks in range(len(cached), 0, -1):
            first_needed = self._first_block_in_window(num_hit_blocks * self.block_size)
            if last_missing_before[num_hit_blocks] >= first_needed:
                continue
            if first_needed > self.num_sink_blocks and num_leading_sinks < self.num_sink_blocks:
                continue
            return [
                block if index < self.num_sink_blocks or index >= first_needed else None
                for index, block in enumerate(cached[:num_hit_blocks])
            ]
        return []

    def _first_block_in_window(self, position: int) -> int:
        """The first block a token at `position` attends to beyond the sinks: every block from 0
        while its window still reaches them."""
        first_block = max(0, position - self.sliding_window + 1) // self.block_size
        return 0 if first_block <= self.num_sink_blocks else first_block

    def admit(self, request: Request, cached_prefix: list[KVBlock | None], num_new_tokens: int) -> bool:
        """Give a request its cached prefix plus blocks for `num_new_tokens` more tokens."""
        num_prefix_tokens = len(cached_prefix) * self.block_size
        num_new_blocks = num_blocks_for(num_prefix_tokens + num_new_tokens, self.block_size) - len(
            cached_prefix
        )
        held_prefix = [block for block in cached_prefix if block is not None]
        num_revived = sum(1 for block in held_prefix if block.ref_cnt == 0)
        if num_new_blocks + num_revived > self.pool.num_free_blocks:
            return False
        self.pool.touch(held_prefix)
        new_blocks = self.pool.allocate(num_new_blocks)
        assert new_blocks is not None  # checked above
        self._blocks[request.req_id] = list(cached_prefix) + new_blocks
        self._num_registered_blocks[request.req_id] = len(cached_prefix)
        # The blocks of a windowed hit's gap count as given back: never held, never released.
        gap_end = max((index + 1 for index, block in enumerate(cached_prefix) if block is None), default=0)
        self._released_until[request.req_id] = max(self.num_sink_blocks, gap_end)
        if self.enable_caching:
            self.stats.num_query_tokens += request.num_tokens
            self.stats.num_hit_tokens += num_prefix_tokens
        self._release_blocks_before_window(request.req_id, num_prefix_tokens)
        return True

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Make room for `num_new_tokens` more tokens of an admitted request (first giving back
        the blocks its window has passed)."""
        self._release_blocks_before_window(request.req_id, request.num_computed_tokens)
        blocks = self._blocks[request.req_id]
        num_needed = num_blocks_for(request.num_computed_tokens + num_new_tokens, self.block_size) - len(
            blocks
        )
        if num_needed <= 0:
            return True
        new_blocks = self.pool.allocate(num_needed)
        if new_blocks is None:
            return False
        blocks.extend(new_blocks)
        return True

    def _release_blocks_before_window(self, req_id: str, num_computed_tokens: int) -> None:
        """Give back the blocks wholly before the window of the request's next token (position
        `num_computed_tokens`): no later query of it attends to them."""
        if self.sliding_window is None:
            return
        first_seen_position = max(0, num_computed_tokens - self.sliding_window + 1)
        num_passed = first_seen_position // self.block_size
        released_until = self._released_until[req_id]
        if num_passed > released_until:
            # Oldest first: with prefix caching, the first to be evicted.
            self.pool.release(self._blocks[req_id][released_until:num_passed])
            self._released_until[req_id] = num_passed

    def register_computed_blocks(self, request: Request) -> None:
        """Index the request's blocks that are now full of computed KV under their prefix hash."""
        if not self.enable_caching:
            return
        blocks = self._blocks[request.req_id]
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_hashes), len(blocks))
        # A block given back unregistered may hold another request's KV by now.
        released = range(self.num_sink_blocks, self._released_until[request.req_id])
        for index in range(self._num_registered_blocks[request.req_id], num_full):
            if index not in released:
                self.pool.cache(blocks[index], request.block_hashes[index])
        self._num_registered_blocks[request.req_id] = max(
            num_full, self._num_registered_blocks[request.req_id]
        )

    def release_blocks_past(self, request: Request, num_tokens: int) -> None:
        """Give back the request's blocks past its first `num_tokens` tokens (those that held
        only rejected proposals)."""
        blocks = self._blocks[request.req_id]
        keep = num_blocks_for(num_tokens, self.block_size)
        if len(blocks) > keep:
            self.pool.release(reversed(blocks[keep:]))
            del blocks[keep:]

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so its tail is evicted before its head."""
        blocks = self._blocks.pop(request.req_id, [])
        self._num_registered_blocks.pop(request.req_id, None)
        released_until = self._released_until.pop(request.req_id, self.num_sink_blocks)
        held = blocks[: self.num_sink_blocks] + blocks[max(released_until, self.num_sink_blocks) :]
        self.pool.release(reversed(held))

    def holds(self, req_id: str) -> bool:
        return req_id in self._blocks

    def pin(self, pin_id: str, block_hashes: list[BlockHash]) -> int:
        """Keep the cached blocks of a prefix resident until unpinned; returns pinned tokens."""
        if pin_id in self._pins:
            raise ValueError(f"prefix {pin_id!r} is already pinned")
        blocks = []
        for block_hash in block_hashes:
            block = self.pool.cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        self.pool.touch(blocks)
        self._pins[pin_id] = blocks
        return len(blocks) * self.block_size

    def unpin(self, pin_id: str) -> None:
        blocks = self._pins.pop(pin_id, None)
        if blocks is None:
            raise ValueError(f"no pinned prefix {pin_id!r}")
        self.pool.release(reversed(blocks))

    def num_pinned_blocks_apart_from(self, block_hashes: list[BlockHash]) -> int:
        """Pinned blocks other than those holding a prefix of `block_hashes` (a request whose
        prompt starts with a pinned prefix shares those blocks rather than needing its own)."""
        shared = set(block_hashes)
        pinned = {block.block_id: block for blocks in self._pins.values() for block in blocks}
        return sum(1 for block in pinned.values() if block.block_hash not in shared)

    def pinned_block_ids(self, pin_id: str) -> list[int]:
        return [block.block_id for block in self._pins[pin_id]]

    def pinned_block_hashes(self, pin_id: str) -> list[BlockHash]:
        return [block.block_hash for block in self._pins[pin_id] if block.block_hash is not None]

    def adopt_pinned_blocks(self, pin_id: str, block_hashes: list[BlockHash]) -> list[int] | None:
        """Allocate, index and pin blocks for a prefix whose KV the caller is about to write
        (restoring a persisted prefix); None if the pool lacks room or caching is off."""
        if not self.enable_caching or pin_id in self._pins:
            return None
        blocks = self.pool.allocate(len(block_hashes))
        if blocks is None:
            return None
        for block, block_hash in zip(blocks, block_hashes):
            self.pool.cache(block, block_hash)
        self._pins[pin_id] = blocks
        return [block.block_id for block in blocks]

    def reset_prefix_cache(self) -> None:
        """Unpin everything and forget every cached prefix."""
        for pin_id in list(self._pins):
            self.unpin(pin_id)
        self.pool.reset_prefix_cache()
