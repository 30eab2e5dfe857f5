from firsttoken.core.hashing import extend_block_hashes, hash_block, root_hash

ROOT = root_hash("model-a")


def test_hash_chain_covers_every_earlier_token():
    tokens = list(range(48))
    hashes: list[bytes] = []
    extend_block_hashes(hashes, tokens, 16, ROOT)
    assert len(hashes) == 3
    assert hashes[0] == hash_block(ROOT, tokens[:16])
    assert hashes[1] == hash_block(hashes[0], tokens[16:32])
    assert hashes[2] == hash_block(hashes[1], tokens[32:48])
    changed = [999] + tokens[1:]
    changed_hashes: list[bytes] = []
    extend_block_hashes(changed_hashes, changed, 16, ROOT)
    # Same tokens in block 2, different first block: every later hash differs too.
    assert all(a != b for a, b in zip(hashes, changed_hashes))


def test_partial_blocks_are_not_hashed_and_extension_is_incremental():
    hashes: list[bytes] = []
    extend_block_hashes(hashes, list(range(20)), 16, ROOT)
    assert len(hashes) == 1
    extend_block_hashes(hashes, list(range(32)), 16, ROOT)
    assert len(hashes) == 2
    fresh: list[bytes] = []
    extend_block_hashes(fresh, list(range(32)), 16, ROOT)
    assert fresh == hashes


def test_root_separates_models():
    tokens = list(range(16))
    assert hash_block(root_hash("model-a"), tokens) != hash_block(root_hash("model-b"), tokens)
