"""Chained block hashes: a block's key covers every token before it, so equal keys mean equal prefixes."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

BlockHash = bytes


def root_hash(extra_key: str) -> BlockHash:
    """The parent of a sequence's first block: separates models, dtypes and block sizes."""
    return hashlib.sha256(b"firsttoken-root:" + extra_key.encode()).digest()


def hash_block(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """SHA-256 of (parent hash, the block's token ids): collisions are not a practical concern."""
    digest = hashlib.sha256(parent)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


def extend_block_hashes(
    block_hashes: list[BlockHash], token_ids: Sequence[int], block_size: int, root: BlockHash
) -> None:
    """Append the hash of every block of `token_ids` that is full and not hashed yet."""
    num_full_blocks = len(token_ids) // block_size
    for block_index in range(len(block_hashes), num_full_blocks):
        parent = block_hashes[-1] if block_hashes else root
        start = block_index * block_size
        block_hashes.append(hash_block(parent, token_ids[start : start + block_size]))
