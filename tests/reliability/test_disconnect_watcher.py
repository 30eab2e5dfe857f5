"""The disconnect watcher of a request's work (tokenizing, admission, a whole reply, a stream's
body): a client that simply left ends the work, and only ClientDisconnected is raised for it."""

from __future__ import annotations

import asyncio

import pytest

from firsttoken.server.streaming import ClientDisconnected, unless_disconnected


class _LeavingClient:
    """An ASGI request whose client goes away once `leave` is set."""

    def __init__(self) -> None:
        self.leave = asyncio.Event()

    async def receive(self) -> dict:
        await self.leave.wait()
        return {"type": "http.disconnect"}


def test_a_client_that_left_cancels_the_work():
    events: list[str] = []

    async def work() -> None:
        try:
            events.append("started")
            await asyncio.Event().wait()
        finally:
            await asyncio.sleep(0)  # cleanup that awaits, as closing engine streams does
            events.append("cleaned up")

    async def scenario() -> None:
        client = _LeavingClient()
        watched = asyncio.create_task(unless_disconnected(client.receive, work()))
        await asyncio.sleep(0.01)
        client.leave.set()
        await watched

    with pytest.raises(ClientDisconnected):
        asyncio.run(scenario())
    assert events == ["started", "cleaned up"]


def test_work_that_completes_first_gives_its_result():
    async def scenario() -> str:
        return await unless_disconnected(_LeavingClient().receive, asyncio.sleep(0, "done"))

    assert asyncio.run(scenario()) == "done"
