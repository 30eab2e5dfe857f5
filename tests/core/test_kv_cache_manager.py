from firsttoken.core.hashing import extend_block_hashes, root_hash
from firsttoken.core.kv_cache_manager import KVCacheManager
from tests.core.fakes import make_request

BLOCK = 4
ROOT = root_hash("test")


def _hashed(request):
    extend_block_hashes(request.block_hashes, request.token_ids, BLOCK, ROOT)
    return request


def _compute_all(manager, request):
    """Pretend a step computed every token of the request."""
    request.num_computed_tokens = request.num_tokens
    manager.register_computed_blocks(request)


def test_admit_allocates_exact_blocks_and_free_returns_them():
    manager = KVCacheManager(8, BLOCK, enable_caching=True)
    request = _hashed(make_request("a", 10))
    assert manager.admit(request, [], 10)
    assert manager.block_ids("a") == [0, 1, 2]
    _compute_all(manager, request)
    manager.free(request)
    assert manager.pool.num_free_blocks == 8
    # The partial last block holds no prefix: reused first. Full blocks enter the LRU tail
    # first: block 1 is evicted before block 0.
    order = manager.pool.free_block_ids_in_eviction_order()
    assert order[0] == 2 and order[-2:] == [1, 0]


def test_cached_prefix_is_reused_and_last_token_is_left_to_compute():
    manager = KVCacheManager(16, BLOCK, enable_caching=True)
    first = _hashed(make_request("a", 12))
    assert manager.admit(first, [], 12)
    _compute_all(manager, first)
    manager.free(first)
    # Exact duplicate: 12 tokens = 3 full blocks, but the last token must be computed,
    # so only 2 blocks (8 tokens) are reused.
    duplicate = _hashed(make_request("b", 12))
    hits = manager.find_cached_prefix(duplicate)
    assert [block.block_id for block in hits] == [0, 1]
    # A longer prompt sharing 12 tokens reuses all 3 blocks.
    longer = _hashed(make_request("c", 0, prompt=list(range(100, 112)) + [7, 8, 9]))
    assert [block.block_id for block in manager.find_cached_prefix(longer)] == [0, 1, 2]


def test_prefix_ending_mid_block_reuses_only_full_blocks():
    manager = KVCacheManager(16, BLOCK, enable_caching=True)
    first = _hashed(make_request("a", 0, prompt=list(range(10)) + [50, 51, 52]))
    assert manager.admit(first, [], first.num_tokens)
    _compute_all(manager, first)
    second = _hashed(make_request("b", 0, prompt=list(range(10)) + [60, 61, 62]))
    hits = manager.find_cached_prefix(second)
    assert len(hits) == 2  # tokens 0..7; block 3 (8, 9, 50, 51) differs


def test_shared_blocks_are_reference_counted():
    manager = KVCacheManager(16, BLOCK, enable_caching=True)
    first = _hashed(make_request("a", 9))
    assert manager.admit(first, [], 9)
    _compute_all(manager, first)
    second = _hashed(make_request("b", 9))
    hits = manager.find_cached_prefix(second)
    assert manager.admit(second, hits, 1)
    assert [block.ref_cnt for block in hits] == [2, 2]
    manager.free(first)
    assert [block.ref_cnt for block in hits] == [1, 1]
    manager.free(second)
    assert manager.pool.num_free_blocks == 16
    assert manager.stats.num_hit_tokens == 8
    assert manager.stats.num_query_tokens == 18


def test_admission_counts_revived_blocks_against_free_space():
    manager = KVCacheManager(3, BLOCK, enable_caching=True)
    first = _hashed(make_request("a", 8))
    assert manager.admit(first, [], 8)
    _compute_all(manager, first)
    manager.free(first)
    second = _hashed(make_request("b", 0, prompt=list(range(100, 108)) + list(range(8))))
    hits = manager.find_cached_prefix(second)
    assert len(hits) == 2
    # 2 revived + 2 new blocks needed, only 3 exist: refused and nothing changes.
    assert not manager.admit(second, hits, 8)
    assert manager.pool.num_free_blocks == 3
    assert not manager.holds("b")


def test_pinned_blocks_are_never_evicted_until_unpinned():
    manager = KVCacheManager(4, BLOCK, enable_caching=True)
    system = _hashed(make_request("sys", 8))
    assert manager.admit(system, [], 8)
    _compute_all(manager, system)
    manager.free(system)
    assert manager.pin("system-prompt", system.block_hashes) == 8
    assert manager.pool.num_free_blocks == 2
    # Fill the whole free pool many times over: the pinned blocks survive.
    for index in range(5):
        other = _hashed(make_request(f"o{index}", 8, first_token=1000 + 10 * index))
        assert manager.admit(other, [], 8)
        _compute_all(manager, other)
        manager.free(other)
    assert len(manager.find_cached_prefix(_hashed(make_request("again", 9)))) == 2
    manager.unpin("system-prompt")
    assert manager.pool.num_free_blocks == 4


def test_reset_frees_everything():
    manager = KVCacheManager(4, BLOCK, enable_caching=True)
    request = _hashed(make_request("a", 8))
    assert manager.admit(request, [], 8)
    _compute_all(manager, request)
    manager.free(request)
    manager.pin("p", request.block_hashes)
    manager.reset_prefix_cache()
    assert manager.pool.num_free_blocks == 4
    assert manager.find_cached_prefix(_hashed(make_request("b", 9))) == []


def test_a_sliding_window_gives_back_the_blocks_it_has_passed_and_frees_the_rest_once():
    """Window 6, blocks of 4: before the step at position p, blocks wholly before p - 5 are
    given back, oldest first (with caching, the first evicted); freeing the request later
    returns only the rest."""
    manager = KVCacheManager(16, BLOCK, enable_caching=True, sliding_window=6)
    request = _hashed(make_request("a", 40))
    assert manager.admit(request, [], 8)
    assert manager.pool.num_free_blocks == 14
    for num_computed in range(8, 40, 4):
        request.num_computed_tokens = num_computed
        manager.register_computed_blocks(request)
        assert manager.allocate_slots(request, 4)
        first_seen = num_computed - 6 + 1
        num_passed = first_seen // BLOCK
        num_held = len(manager.block_ids("a")) - num_passed
        assert manager.pool.num_free_blocks == 16 - num_held
        assert num_held <= -(-(6 + 4) // BLOCK) + 1
    # Given back in order: the request's first blocks are the first to be evicted.
    assert manager.pool.free_block_ids_in_eviction_order()[-7:] == manager.block_ids("a")[:7]
    request.num_computed_tokens = 40
    manager.register_computed_blocks(request)
    manager.free(request)
    assert manager.pool.num_free_blocks == 16


def test_a_window_long_enough_for_a_prefix_hit_revives_only_what_it_needs_to_keep():
    """A hit on a 32-token prefix under a window of 6: the blocks before the window of the
    first new token go straight back; the request holds the window's blocks and its new ones."""
    manager = KVCacheManager(16, BLOCK, enable_caching=True, sliding_window=6)
    first = _hashed(make_request("a", 36))
    assert manager.admit(first, [], 36)
    _compute_all(manager, first)
    manager.free(first)
    second = _hashed(make_request("b", 36))
    hits = manager.find_cached_prefix(second)
    assert len(hits) == 8
    assert manager.admit(second, hits, 4)
    # Position 32 sees 27..32: blocks 0-5 (tokens 0..23) given back; 6, 7 and one new block held.
    assert manager.pool.num_free_blocks == 16 - 3
    manager.free(second)
    assert manager.pool.num_free_blocks == 16


def _streamed_then_freed(manager, req_id, num_tokens):
    """A request prefilled 8 tokens then decoded 4 a step: the blocks its window passes are
    given back as it goes (the oldest first in the eviction order), the rest when it is freed."""
    request = _hashed(make_request(req_id, num_tokens))
    assert manager.admit(request, [], 8)
    for num_computed in range(8, num_tokens, 4):
        request.num_computed_tokens = num_computed
        manager.register_computed_blocks(request)
        assert manager.allocate_slots(request, 4)
    _compute_all(manager, request)
    manager.free(request)
    return request


def _hold(manager, req_id, num_blocks):
    """A request holding `num_blocks` new blocks: the empty ones first, then the least recently
    freed cached ones, evicted."""
    request = _hashed(make_request(req_id, BLOCK * num_blocks))
    assert manager.admit(request, [], request.num_tokens)
    return request


# After a 36-token request on 16 blocks of 4: 9 blocks cached, 7 never written.
NUM_EMPTY = 16 - 9


def test_a_windowed_hit_needs_only_the_sinks_and_the_window_of_its_next_token():
    """Window 6 and one sink block: a conversation of 36 tokens, its blocks 1-3 evicted since; the
    next turn (40 tokens) hits 36 of them: block 0 (the sinks) and 7-8 (position 36's window,
    tokens 31..35); blocks 1-6 it never holds, and reads as block 0 in its table."""
    manager = KVCacheManager(16, BLOCK, enable_caching=True, sliding_window=6, sink_tokens=4)
    first = _streamed_then_freed(manager, "a", 36)
    filler = _hold(manager, "filler", NUM_EMPTY + 3)
    assert all(manager.pool.cached_block(first.block_hashes[index]) is None for index in (1, 2, 3))
    second = _hashed(make_request("b", 40))
    hits = manager.find_cached_prefix(second)
    assert len(hits) == 9
    assert [block is None for block in hits] == [False] + [True] * 6 + [False, False]
    free_before = manager.pool.num_free_blocks
    assert manager.admit(second, hits, 4)
    assert manager.pool.num_free_blocks == free_before - 4  # blocks 0, 7, 8 revived, one new
    assert manager.block_ids("b")[1:7] == [0] * 6
    assert manager.stats.num_hit_tokens == 36
    manager.free(second)
    manager.free(filler)
    assert manager.pool.num_free_blocks == 16


def test_a_windowed_hit_stops_where_its_window_or_sinks_are_gone():
    """With position 36's window evicted too, no later block's window is whole: the hit is the
    first block (whose window is every key from 0); with the sinks evicted, nothing."""
    manager = KVCacheManager(16, BLOCK, enable_caching=True, sliding_window=6, sink_tokens=4)
    first = _streamed_then_freed(manager, "a", 36)
    # Eviction order: the passed blocks 1-5, then (freed tail first) 8, 7, 6, 0.
    _hold(manager, "filler", NUM_EMPTY + 7)
    hits = manager.find_cached_prefix(_hashed(make_request("b", 40)))
    assert [block.block_hash for block in hits] == first.block_hashes[:1]

    manager = KVCacheManager(16, BLOCK, enable_caching=True, sliding_window=6, sink_tokens=4)
    first = _streamed_then_freed(manager, "a", 36)
    # Position 36's window kept (pinned), every other cached block evicted, the sinks last.
    assert manager.pin("window", first.block_hashes[6:9]) == 3 * BLOCK
    _hold(manager, "filler", 16 - 3)
    assert manager.find_cached_prefix(_hashed(make_request("b", 40))) == []
