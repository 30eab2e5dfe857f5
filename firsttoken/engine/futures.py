"""Answering a future across threads: the engine loop answers what the asyncio side asked."""

from __future__ import annotations

import concurrent.futures
from typing import Any


def settle_future(
    future: concurrent.futures.Future[Any], result: Any = None, error: BaseException | None = None
) -> None:
    """Give a result to a future the asyncio side may have cancelled meanwhile (nobody waits)."""
    try:
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)
    except concurrent.futures.InvalidStateError:
        pass
