"""Pinned prefixes' KV between the paged cache and their files: a pin's blocks copied out when
it is made, copied back into the blocks given to it when a later engine restores it.
"""

from __future__ import annotations

import torch

from firsttoken.config import EngineConfig
from firsttoken.models.loaders.checkpoint import Checkpoint
from firsttoken.worker.pinned_prefix_store import (
    KVIdentity,
    PinnedPrefixStore,
    StoredPrefix,
    projections_form,
)


class PinnedPrefixKV:
    """Owns the store of persisted pinned prefixes (None when they do not persist) and copies
    their blocks in and out of the paged KV tensors, which the worker owns."""

    def __init__(
        self, store: PinnedPrefixStore | None, kv_caches: list[torch.Tensor], device: torch.device
    ) -> None:
        self.store = store
        self.kv_caches = kv_caches
        self.device = device

    def stored(self) -> list[StoredPrefix]:
        """The pinned prefixes saved by earlier engines of the same KV identity."""
        return self.store.load_all() if self.store is not None else []

    def save(
        self, pin_id: str, token_ids: list[int], block_hashes: list[bytes], block_ids: list[int]
    ) -> None:
        """Write a pinned prefix's KV blocks to its file (when pinned prefixes persist)."""
        if self.store is not None:
            self.store.save(pin_id, token_ids, block_hashes, self._read_blocks(block_ids))

    def delete(self, pin_id: str) -> None:
        if self.store is not None:
            self.store.delete(pin_id)

    def restore(self, stored: StoredPrefix, block_ids: list[int]) -> None:
        """Copy a stored prefix's KV into the blocks given to it."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        for layer, kv_cache in enumerate(self.kv_caches):
            kv_cache.index_copy_(1, index, stored.kv[layer].to(device=self.device, dtype=kv_cache.dtype))

    def _read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """[layers, 2, blocks, block_size, kv_heads, head_dim] copy of those blocks' KV."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        return torch.stack([kv_cache.index_select(1, index) for kv_cache in self.kv_caches])


def open_prefix_store(
    config: EngineConfig, checkpoint: Checkpoint, dtype: torch.dtype
) -> PinnedPrefixStore | None:
    """The folder of persisted pinned prefixes for this model's KV; None when they do not persist."""
    folder = config.prompt_cache.persist_dir
    if folder is None or not config.prompt_cache.enable:
        return None
    arch = checkpoint.arch
    identity = KVIdentity(
        model_fingerprint=checkpoint.fingerprint,
        dtype=str(dtype).removeprefix("torch."),
        block_size=config.cache.block_size,
        num_layers=arch.num_layers,
        num_kv_heads=arch.num_kv_heads,
        head_dim=arch.head_dim,
        projections=projections_form(config.model_config),
    )
    return PinnedPrefixStore(folder, identity)
