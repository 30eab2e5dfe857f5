"""A clock the fake server moves instead of sleeping, so timings come back exact at any load."""

from __future__ import annotations

import asyncio
import threading
import time

# A client that never reads the time of a chunk is a broken client: fail instead of hanging.
READ_WAIT_LIMIT_S = 60.0


class ScriptedClock:
    """Time that moves only when told: by the fake server's scripted delays, or by the client's
    waits between arrivals. Reads are counted so the server can wait until the client has
    stamped one chunk before it moves the clock on to the next."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._now_s = 0.0
        self._num_reads = 0

    def now(self) -> float:
        with self._lock:
            self._num_reads += 1
            return self._now_s

    @property
    def num_reads(self) -> int:
        with self._lock:
            return self._num_reads

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._now_s += seconds

    async def sleep(self, seconds: float) -> None:
        """The client's wait for its next arrival: first let the requests already created
        stamp their start, then jump the clock."""
        await asyncio.sleep(0)
        self.advance(seconds)

    async def wait_for_read_after(self, num_reads: int) -> None:
        """Return once someone has read the clock more than `num_reads` times in all."""
        deadline = time.monotonic() + READ_WAIT_LIMIT_S
        while self.num_reads <= num_reads:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the client did not read the clock within {READ_WAIT_LIMIT_S} s")
            await asyncio.sleep(0.001)
