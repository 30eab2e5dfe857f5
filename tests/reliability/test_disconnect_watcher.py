"""A non-streamed reply's disconnect watcher: a client that simply left ends the work, and
nothing is raised or logged for it."""

from __future__ import annotations

import asyncio

from firsttoken.server.streaming import unless_disconnected


class _LeavingClient:
    """An ASGI request whose client goes away once `leave` is set."""

    def __init__(self) -> None:
        self.leave = asyncio.Event()

    async def receive(self) -> dict:
        await self.leave.wait()
        return {"type": "http.disconnect"}


def test_a_client_that_left_cancels_the_work_and_raises_nothing():
    events: list[str] = []

    async def work() -> None:
        try:
            events.append("started")
            await asyncio.Event().wait()
        finally:
            await asyncio.sleep(0)  # cleanup that awaits, as closing engine streams does
            events.append("cleaned up")

    async def scenario() -> bool:
        client = _LeavingClient()
        watched = asyncio.create_task(unless_disconnected(client, work()))
        await asyncio.sleep(0.01)
        client.leave.set()
        return await watched

    assert asyncio.run(scenario()) is False
    assert events == ["started", "cleaned up"]


def test_work_that_completes_first_is_reported_as_completed():
    async def scenario() -> bool:
        return await unless_disconnected(_LeavingClient(), asyncio.sleep(0))

    assert asyncio.run(scenario()) is True
