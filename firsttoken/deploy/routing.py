"""The prefix-aware routing decision, without Ray: which replica should take a request.

A request is routed on the chained block hashes of its prompt's first blocks, the keys the
replicas' prefix caches hold their KV under (firsttoken.core.hashing), so "replica R holds the
first k blocks" means R can skip k blocks of prefill. Keys are the hashes' first 8 bytes: a
replica reports thousands of them every second, and a collision only costs one worse route.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

from firsttoken.core.hashing import BlockHash, extend_block_hashes

ROUTING_KEY_BYTES = 8


def prompt_block_hashes(
    token_ids: Sequence[int], block_size: int, root: BlockHash, max_blocks: int
) -> list[BlockHash]:
    """The hashes of the prompt's first full blocks (at most `max_blocks`) that a prefix cache
    could serve: never the block of the last token, whose logits must be computed."""
    num_tokens = min(len(token_ids) - 1, max_blocks * block_size)
    block_hashes: list[BlockHash] = []
    extend_block_hashes(block_hashes, token_ids[: max(num_tokens, 0)], block_size, root)
    return block_hashes


def routing_key(block_hash: BlockHash) -> bytes:
    return block_hash[:ROUTING_KEY_BYTES]


def pack_keys(keys: Iterable[bytes]) -> bytes:
    """Keys as one bytes object: small to report and cheap to compare across reports."""
    return b"".join(keys)


def unpack_keys(packed: bytes) -> frozenset[bytes]:
    return frozenset(
        packed[start : start + ROUTING_KEY_BYTES] for start in range(0, len(packed), ROUTING_KEY_BYTES)
    )


def num_matched_blocks(request_keys: Sequence[bytes], held_keys: Collection[bytes]) -> int:
    """How many of the request's first blocks a replica holding `held_keys` has, in a row."""
    num_matched = 0
    for key in request_keys:
        if key not in held_keys:
            break
        num_matched += 1
    return num_matched


@dataclass(frozen=True)
class ReplicaView:
    """What the router knows of one replica when routing one request."""

    replica: str
    num_ongoing: int  # requests it is serving or queueing (Ray Serve's queue length)
    num_matched_blocks: int  # the request's first blocks its prefix cache holds
    num_held_blocks: int  # prefix blocks it is known to hold in all


def rank_replicas(views: Sequence[ReplicaView], imbalance_bound: int) -> list[str]:
    """Replica names, best first.

    The replica holding the longest match of the request's first blocks comes first, unless it
    has more than `imbalance_bound` requests beyond the least-loaded replica: then (and when no
    replica holds a match) the least loaded comes first, the one holding fewest prefix blocks
    among equals, so that new prefixes spread. The others follow by load, as fallbacks for a
    replica that refuses (its queue full).
    """
    by_load = sorted(views, key=lambda view: (view.num_ongoing, view.num_held_blocks, view.replica))
    if not by_load:
        return []
    least_load = by_load[0].num_ongoing
    eligible = [
        view
        for view in by_load
        if view.num_matched_blocks > 0 and view.num_ongoing - least_load <= imbalance_bound
    ]
    if not eligible:
        return [view.replica for view in by_load]
    best = max(eligible, key=lambda view: view.num_matched_blocks)  # the least loaded of equals
    return [best.replica] + [view.replica for view in by_load if view is not best]


class RoutedPrefixes:
    """The keys this router sent to each replica lately, with when: a replica reports what its
    prefix cache holds only every so often, and a prefix routed a moment ago must already count
    (or its next requests would spread before the report arrives). Entries expire after
    `memory_s`, by when the replica's own reports cover them."""

    def __init__(self, memory_s: float) -> None:
        self.memory_s = memory_s
        self._routed: dict[str, dict[bytes, float]] = {}

    def record(self, replica: str, keys: Iterable[bytes], now: float) -> None:
        routed = self._routed.setdefault(replica, {})
        for key in keys:
            routed.pop(key, None)  # re-inserted at the end: the dict stays oldest first
            routed[key] = now

    def held(self, replica: str, now: float) -> dict[bytes, float]:
        """The keys recorded for `replica` within the memory (expired ones are dropped)."""
        routed = self._routed.get(replica, {})
        while routed:
            oldest_key, routed_at = next(iter(routed.items()))
            if now - routed_at <= self.memory_s:
                break
            del routed[oldest_key]
        return routed

    def forget(self, replica: str) -> None:
        self._routed.pop(replica, None)
