import pytest

from firsttoken.core.block_pool import BlockPool


def test_allocate_takes_blocks_in_free_order_and_fails_whole():
    pool = BlockPool(4, enable_caching=True)
    first = pool.allocate(3)
    assert [block.block_id for block in first] == [0, 1, 2]
    assert pool.allocate(2) is None
    assert pool.num_free_blocks == 1
    assert all(block.ref_cnt == 1 for block in first)


def test_cached_blocks_join_the_lru_tail_in_given_order():
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.allocate(4)
    for block in blocks:
        pool.cache(block, f"hash-{block.block_id}".encode())
    pool.release(reversed(blocks[:3]))
    assert pool.free_block_ids_in_eviction_order() == [2, 1, 0]
    pool.release([blocks[3]])
    assert pool.free_block_ids_in_eviction_order() == [2, 1, 0, 3]


def test_empty_blocks_go_first_most_recently_freed_first():
    """A block without a cached prefix is reused before any cached block is evicted, and the
    warmest of them (the last freed) before blocks never written."""
    pool = BlockPool(5, enable_caching=True)
    a, b, c = pool.allocate(3)
    pool.cache(a, b"hash-a")
    pool.release([a, b, c])
    assert pool.free_block_ids_in_eviction_order() == [c.block_id, b.block_id, 3, 4, a.block_id]
    (warmest,) = pool.allocate(1)
    assert warmest is c
    reused = pool.allocate(3)
    assert [block.block_id for block in reused] == [b.block_id, 3, 4]
    assert pool.cached_block(b"hash-a") is a
    (evicted,) = pool.allocate(1)
    assert evicted is a and pool.cached_block(b"hash-a") is None


def test_eviction_forgets_hash_and_revival_removes_from_free_list():
    pool = BlockPool(3, enable_caching=True)
    a, b, c = pool.allocate(3)
    pool.cache(a, b"hash-a")
    pool.cache(b, b"hash-b")
    pool.release([b, a, c])  # eviction order: c (holds no prefix), then b, a
    assert pool.cached_block(b"hash-a") is a
    pool.touch([a])  # revive a: out of the free list, referenced again
    assert a.ref_cnt == 1
    assert pool.free_block_ids_in_eviction_order() == [c.block_id, b.block_id]
    evicted, empty = pool.allocate(2)  # handed out in ascending ids
    assert empty is c and evicted is b
    assert pool.cached_block(b"hash-b") is None
    assert evicted.block_hash is None
    assert pool.cached_block(b"hash-a") is a


def test_blocks_are_handed_out_in_ascending_ids():
    """A request freed tail first, then evicted, comes back as one run of ids (read in place)."""
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.allocate(4)
    for index, block in enumerate(blocks):
        pool.cache(block, f"hash-{index}".encode())
    pool.release(reversed(blocks))
    assert pool.free_block_ids_in_eviction_order() == [3, 2, 1, 0]
    assert [block.block_id for block in pool.allocate(3)] == [1, 2, 3]


def test_reset_turns_free_cached_blocks_into_empty_ones():
    pool = BlockPool(2, enable_caching=True)
    a, b = pool.allocate(2)
    pool.cache(a, b"hash-a")
    pool.release([a, b])
    pool.reset_prefix_cache()
    assert pool.cached_block(b"hash-a") is None
    assert pool.free_block_ids_in_eviction_order() == [a.block_id, b.block_id]
    assert pool.num_free_blocks == 2


def test_shared_block_is_freed_only_by_its_last_holder():
    pool = BlockPool(2, enable_caching=True)
    (block,) = pool.allocate(1)
    pool.touch([block])
    pool.release([block])
    assert pool.num_free_blocks == 1
    pool.release([block])
    assert pool.num_free_blocks == 2
    with pytest.raises(RuntimeError):
        pool.release([block])


def test_first_holder_of_a_prefix_wins_and_caching_off_caches_nothing():
    pool = BlockPool(2, enable_caching=True)
    first, second = pool.allocate(2)
    pool.cache(first, b"same")
    pool.cache(second, b"same")
    assert pool.cached_block(b"same") is first
    assert second.block_hash is None
    off = BlockPool(1, enable_caching=False)
    (block,) = off.allocate(1)
    off.cache(block, b"x")
    assert off.cached_block(b"x") is None


def test_reset_forgets_all_prefixes():
    pool = BlockPool(2, enable_caching=True)
    blocks = pool.allocate(2)
    pool.cache(blocks[0], b"h")
    pool.release(blocks)
    pool.reset_prefix_cache()
    assert pool.cached_block(b"h") is None
    assert pool.num_free_blocks == 2
