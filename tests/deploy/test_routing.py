"""The prefix-aware routing decision without Ray: keys, matches, ranking, the routed memory."""

from __future__ import annotations

from firsttoken.core.hashing import extend_block_hashes, root_hash
from firsttoken.deploy.routing import (
    ReplicaView,
    RoutedPrefixes,
    num_matched_blocks,
    pack_keys,
    prompt_block_hashes,
    rank_replicas,
    routing_key,
    unpack_keys,
)

ROOT = root_hash("test")


def view(replica: str, num_ongoing: int = 0, num_matched: int = 0, num_held: int = 0) -> ReplicaView:
    return ReplicaView(replica, num_ongoing, num_matched, num_held)


def test_prompt_hashes_are_the_prefix_caches_and_leave_the_last_token_out():
    token_ids = list(range(100, 164))  # exactly 4 blocks of 16
    engine_hashes: list[bytes] = []
    extend_block_hashes(engine_hashes, token_ids, 16, ROOT)
    assert prompt_block_hashes(token_ids, 16, ROOT, max_blocks=64) == engine_hashes[:3]
    assert prompt_block_hashes(token_ids + [7], 16, ROOT, max_blocks=64) == engine_hashes
    assert prompt_block_hashes(token_ids, 16, ROOT, max_blocks=2) == engine_hashes[:2]
    assert prompt_block_hashes([1], 16, ROOT, max_blocks=64) == []


def test_keys_pack_and_unpack():
    hashes = prompt_block_hashes(list(range(200)), 16, ROOT, max_blocks=64)
    keys = [routing_key(block_hash) for block_hash in hashes]
    assert len(set(keys)) == len(keys) == 12
    assert unpack_keys(pack_keys(keys)) == frozenset(keys)
    assert unpack_keys(b"") == frozenset()


def test_a_match_is_a_run_from_the_first_block():
    assert num_matched_blocks([b"a", b"b", b"c"], {b"a", b"b"}) == 2
    assert num_matched_blocks([b"a", b"b", b"c"], {b"b", b"c"}) == 0
    assert num_matched_blocks([], {b"a"}) == 0


def test_the_longest_match_wins_and_the_rest_follow_by_load():
    views = [view("a", 1, num_matched=2), view("b", 0), view("c", 2, num_matched=5)]
    assert rank_replicas(views, imbalance_bound=4) == ["c", "b", "a"]


def test_a_match_too_busy_beyond_the_bound_loses_to_the_least_loaded():
    views = [view("busy", 5, num_matched=8), view("idle", 0)]
    assert rank_replicas(views, imbalance_bound=4) == ["idle", "busy"]
    assert rank_replicas(views, imbalance_bound=5) == ["busy", "idle"]


def test_a_shorter_match_within_the_bound_beats_a_longer_one_beyond_it():
    views = [view("long", 6, num_matched=8), view("short", 1, num_matched=2), view("idle", 0)]
    assert rank_replicas(views, imbalance_bound=2)[0] == "short"


def test_without_a_match_the_least_loaded_then_the_emptiest_comes_first():
    views = [view("a", 1), view("b", 0, num_held=30), view("c", 0, num_held=3)]
    assert rank_replicas(views, imbalance_bound=4) == ["c", "b", "a"]
    assert rank_replicas([], imbalance_bound=4) == []


def test_equal_matches_go_to_the_less_loaded():
    views = [view("a", 2, num_matched=3), view("b", 1, num_matched=3)]
    assert rank_replicas(views, imbalance_bound=4)[0] == "b"


def test_routed_prefixes_are_remembered_for_a_while():
    routed = RoutedPrefixes(memory_s=5.0)
    routed.record("a", [b"k1", b"k2"], now=100.0)
    routed.record("a", [b"k2"], now=103.0)
    assert set(routed.held("a", now=104.0)) == {b"k1", b"k2"}
    assert set(routed.held("a", now=106.0)) == {b"k2"}, "k1 expired, k2 was routed again at 103"
    assert routed.held("b", now=106.0) == {}
    routed.forget("a")
    assert routed.held("a", now=106.0) == {}
