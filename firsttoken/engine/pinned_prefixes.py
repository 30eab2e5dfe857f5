"""Pinned prefixes: prompt prefixes computed once whose KV blocks then stay resident (and, with a
prompt-cache `persist_dir`, saved to disk and restored by the next engine) until unpinned."""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
from collections.abc import KeysView, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from firsttoken.arithmetic import ceil_div
from firsttoken.core.hashing import BlockHash, extend_block_hashes
from firsttoken.core.kv_cache_manager import KVCacheManager
from firsttoken.engine.futures import settle_future
from firsttoken.errors import InvalidInputError
from firsttoken.outputs import PinnedPrefix
from firsttoken.request import Request
from firsttoken.worker.pinned_prefix_store import StoredPrefix, validate_pin_id

logger = logging.getLogger(__name__)


class PrefixStorage(Protocol):
    """Where pinned prefixes' KV is copied to and from (the worker, which holds the tensors)."""

    def stored_prefixes(self) -> list[StoredPrefix]: ...

    def save_prefix(
        self, pin_id: str, token_ids: list[int], block_hashes: list[bytes], block_ids: list[int]
    ) -> None: ...

    def delete_prefix(self, pin_id: str) -> None: ...

    def restore_prefix(self, stored: StoredPrefix, block_ids: list[int]) -> None: ...


@dataclass
class _PinUnderWay:
    """A pin whose prefix a request is computing, and the futures waiting for it."""

    pin_id: str
    num_blocks: int
    waiters: list[concurrent.futures.Future[PinnedPrefix]] = field(default_factory=list)


class PinnedPrefixes:
    """Owns one engine's pinned prefixes: those resident (their blocks pinned in the KV manager,
    their files in the storage), the pins being computed by a request of the engine, and who
    waits for each."""

    def __init__(
        self,
        kv_manager: KVCacheManager,
        storage: PrefixStorage,
        hash_root: BlockHash,
        enabled: bool,
        max_pinned_fraction: float,
        max_model_len: int,
    ) -> None:
        """`enabled`: whether the prompt cache, where pins live, is on; `max_pinned_fraction`:
        the share of the KV blocks pins may hold together; `max_model_len`: the longest request,
        which must always fit beside them."""
        self.kv_manager = kv_manager
        self.storage = storage
        self.hash_root = hash_root
        self.block_size = kv_manager.block_size
        self.enabled = enabled
        self.max_pinned_fraction = max_pinned_fraction
        self.max_model_len = max_model_len
        self.resident: dict[str, PinnedPrefix] = {}
        # The resident pins as one immutable value, replaced on every change, so that another
        # thread (the asyncio side of AsyncEngine) reads a consistent view without a lock.
        self.snapshot: tuple[PinnedPrefix, ...] = ()
        self._under_way: dict[str, _PinUnderWay] = {}  # by the internal req_id computing it

    # -- lookups ---------------------------------------------------------------------------

    def resident_pin(self, pin_id: str, token_ids: list[int]) -> PinnedPrefix | None:
        """The pin `pin_id` if it already holds the full blocks of `token_ids`, else None."""
        existing = self.resident.get(pin_id)
        num_full = len(token_ids) // self.block_size * self.block_size
        if existing is None or existing.token_ids != token_ids[:num_full]:
            return None
        return existing

    @property
    def computing_req_ids(self) -> KeysView[str]:
        """The internal requests computing pins (the engine's own: they never expire)."""
        return self._under_way.keys()

    @property
    def num_pinned_tokens(self) -> int:
        return sum(prefix.num_tokens for prefix in self.resident.values())

    # -- pinning ---------------------------------------------------------------------------

    def check_can_pin(self, pin_id: str, token_ids: list[int]) -> None:
        """Raise InvalidInputError unless a new pin `pin_id` of `token_ids` may start."""
        if not self.enabled:
            raise InvalidInputError("pin_prefix", "the prompt cache is disabled (enable_prompt_cache=False)")
        validate_pin_id(pin_id)
        if len(token_ids) < self.block_size:
            raise InvalidInputError(
                "prefix",
                f"{len(token_ids)} tokens is shorter than one KV block ({self.block_size} tokens); "
                "nothing to pin",
            )
        if pin_id in self.resident or any(pin.pin_id == pin_id for pin in self._under_way.values()):
            raise InvalidInputError("pin_id", f"{pin_id!r} is already pinned")
        self._check_pinned_blocks_limit(len(token_ids) // self.block_size)

    def _check_pinned_blocks_limit(self, num_new_blocks: int) -> None:
        """Pins never give up their blocks, so together they may hold only a share of the cache,
        and never so much that a request of max_model_len tokens could not fit beside them."""
        num_pinned = sum(len(pinned.token_ids) // self.block_size for pinned in self.resident.values())
        num_pinned += sum(pin.num_blocks for pin in self._under_way.values())
        num_blocks = self.kv_manager.num_blocks
        share_limit = int(self.max_pinned_fraction * num_blocks)
        num_request_blocks = ceil_div(self.max_model_len, self.block_size)
        room_limit = max(0, num_blocks - num_request_blocks)
        if num_pinned + num_new_blocks <= min(share_limit, room_limit):
            return
        would_pin = f"pinning {num_new_blocks} more KV blocks would make {num_pinned + num_new_blocks} pinned"
        if room_limit < share_limit:
            raise InvalidInputError(
                "prefix",
                f"{would_pin}, leaving fewer than the {num_request_blocks} blocks a request of max_model_len "
                f"({self.max_model_len} tokens) needs of the cache's {num_blocks}; unpin a prefix, lower "
                "max_model_len or give the KV cache more memory",
            )
        raise InvalidInputError(
            "prefix",
            f"{would_pin}, over the limit of {share_limit} ({self.max_pinned_fraction:g} of {num_blocks}: "
            "max_pinned_fraction); unpin a prefix first",
        )

    def start(self, pin_id: str, req_id: str, num_tokens: int) -> None:
        """Record that request `req_id` computes the `num_tokens` tokens of pin `pin_id`."""
        self._under_way[req_id] = _PinUnderWay(pin_id, num_tokens // self.block_size)

    def wait_for(self, pin_id: str, done: concurrent.futures.Future[PinnedPrefix]) -> bool:
        """Have `done` get the pin `pin_id` once computed; False if no such pin is under way."""
        for pin in self._under_way.values():
            if pin.pin_id == pin_id:
                pin.waiters.append(done)
                return True
        return False

    def complete(self, request: Request) -> None:
        """The request computing a pin finished its prefill: pin its full blocks, save them,
        and hand the pin to whoever waits for it."""
        pin = self._under_way.pop(request.req_id)
        num_tokens = self.kv_manager.pin(pin.pin_id, request.block_hashes[: pin.num_blocks])
        pinned = PinnedPrefix(pin.pin_id, request.prompt_token_ids[:num_tokens])
        self._set_resident(pinned)
        self.storage.save_prefix(
            pin.pin_id,
            pinned.token_ids,
            self.kv_manager.pinned_block_hashes(pin.pin_id),
            self.kv_manager.pinned_block_ids(pin.pin_id),
        )
        for done in pin.waiters:
            settle_future(done, pinned)

    def abandon(self, req_id: str) -> None:
        """The request computing a pin ended early (aborted): no pin comes of it."""
        self._under_way.pop(req_id, None)

    def fail_waiters(self, error: BaseException) -> None:
        """Fail every future waiting for a pin under way with `error`."""
        for pin in self._under_way.values():
            for done in pin.waiters:
                settle_future(done, error=error)
            pin.waiters.clear()

    # -- unpinning and restoring -----------------------------------------------------------

    def unpin(self, pin_id: str) -> None:
        if pin_id not in self.resident:
            raise InvalidInputError("pin_id", f"no pinned prefix {pin_id!r}")
        self.kv_manager.unpin(pin_id)
        del self.resident[pin_id]
        self.snapshot = tuple(self.resident.values())
        self.storage.delete_prefix(pin_id)

    def forget_resident(self) -> None:
        """Forget every resident pin (the KV manager dropped their blocks; files stay on disk)."""
        self.resident.clear()
        self.snapshot = ()

    def restore_stored(self) -> None:
        """Adopt the prefixes an earlier engine of the same KV identity saved, when they fit."""
        for stored in self.storage.stored_prefixes():
            token_ids = stored.token_ids[: len(stored.block_hashes) * self.block_size]
            expected_hashes: list[bytes] = []
            extend_block_hashes(expected_hashes, token_ids, self.block_size, self.hash_root)
            if expected_hashes != stored.block_hashes or stored.pin_id in self.resident:
                logger.warning(
                    "prompt cache: refusing %s: its hashes do not match this engine", stored.pin_id
                )
                continue
            block_ids = self.kv_manager.adopt_pinned_blocks(stored.pin_id, stored.block_hashes)
            if block_ids is None:
                logger.warning("prompt cache: no room to restore %s", stored.pin_id)
                continue
            self.storage.restore_prefix(stored, block_ids)
            self._set_resident(PinnedPrefix(stored.pin_id, token_ids))
            logger.info("prompt cache: restored %s (%d tokens)", stored.pin_id, len(token_ids))

    def _set_resident(self, pinned: PinnedPrefix) -> None:
        self.resident[pinned.pin_id] = pinned
        self.snapshot = tuple(self.resident.values())


def default_pin_id(token_ids: Sequence[int]) -> str:
    """A pin id named by its tokens, so that pinning the same prefix again names the same pin."""
    return "prefix-" + hashlib.sha256(repr(list(token_ids)).encode()).hexdigest()[:16]
