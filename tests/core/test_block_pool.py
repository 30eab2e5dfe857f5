import pytest

from firsttoken.core.block_pool import BlockPool


def test_allocate_takes_blocks_in_free_order_and_fails_whole():
    pool = BlockPool(4, enable_caching=True)
    first = pool.allocate(3)
    assert [block.block_id for block in first] == [0, 1, 2]
    assert pool.allocate(2) is None
    assert pool.num_free_blocks == 1
    assert all(block.ref_cnt == 1 for block in first)


def test_release_appends_to_lru_tail_in_given_order():
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.allocate(4)
    pool.release(reversed(blocks[:3]))
    assert pool.free_block_ids_in_eviction_order() == [2, 1, 0]
    pool.release([blocks[3]])
    assert pool.free_block_ids_in_eviction_order() == [2, 1, 0, 3]


def test_eviction_forgets_hash_and_revival_removes_from_free_list():
    pool = BlockPool(3, enable_caching=True)
    a, b, c = pool.allocate(3)
    pool.cache(a, b"hash-a")
    pool.cache(b, b"hash-b")
    pool.release([b, a, c])  # eviction order: b, a, c
    assert pool.cached_block(b"hash-a") is a
    pool.touch([a])  # revive a: out of the free list, referenced again
    assert a.ref_cnt == 1
    assert pool.free_block_ids_in_eviction_order() == [b.block_id, c.block_id]
    (evicted,) = pool.allocate(1)
    assert evicted is b
    assert pool.cached_block(b"hash-b") is None
    assert evicted.block_hash is None
    assert pool.cached_block(b"hash-a") is a


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
