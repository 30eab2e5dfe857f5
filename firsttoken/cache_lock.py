"""One builder per on-disk cache entry: processes starting together (tensor-parallel ranks,
replicas, test workers) wait for the first one's kernel build or weight conversion and then
read its result, instead of each paying for the same work on the same cores."""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Iterator

from filelock import FileLock, Timeout

logger = logging.getLogger(__name__)

# How long to wait quietly before saying that another process holds the entry.
_QUIET_WAIT_S = 1.0


@contextlib.contextmanager
def building(lock_path: str, what: str) -> Iterator[None]:
    """Hold the lock at `lock_path` (the entry's own) while checking for and building `what`.
    Where the lock cannot be taken (a read-only cache folder), build without it: concurrent
    builders then only repeat work, as each entry is written atomically."""
    lock = _acquired_lock(lock_path, what)
    try:
        yield
    finally:
        if lock is not None:
            lock.release()


def _acquired_lock(lock_path: str, what: str) -> FileLock | None:
    try:
        os.makedirs(os.path.dirname(lock_path), exist_ok=True)
        lock = FileLock(lock_path)
        try:
            lock.acquire(timeout=_QUIET_WAIT_S)
        except Timeout:
            logger.info("waiting for another process building %s", what)
            lock.acquire()
    except OSError as error:
        logger.debug("building %s without a lock (%s)", what, error)
        return None
    return lock
