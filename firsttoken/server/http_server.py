"""The uvicorn server (uvloop, httptools) that runs the app: Nagle's algorithm off, and a
shutdown that drains in-flight requests for a bounded time, then ends the rest in-band."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
import time
from typing import Awaitable, Callable, Iterator

import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from firsttoken.server.config import ServerConfig

logger = logging.getLogger(__name__)

# After in-flight requests were ended, how long their error events and 503s may take to leave
# before the server stops waiting for their connections (a client that stopped reading).
_FLUSH_AFTER_ABORT_S = 5.0
_POLL_S = 0.05


class NoDelayHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol that sets TCP_NODELAY on every accepted socket, so a small
    SSE chunk leaves at once instead of waiting for the previous chunk's ACK (Nagle)."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        super().connection_made(transport)


class DrainingServer(uvicorn.Server):
    """uvicorn's server with a bounded drain. The first SIGTERM or Ctrl-C stops accepting and lets
    in-flight requests finish for up to `shutdown_timeout_s`; then, or at a second signal,
    `abort_in_flight` ends the rest (a stream gets an error event and [DONE], a whole reply a
    503). Owns whether the drain was clean, and re-raises only Ctrl-C afterwards (status 130),
    so that a SIGTERM ends in the status the caller returns."""

    def __init__(
        self,
        config: uvicorn.Config,
        abort_in_flight: Callable[[], Awaitable[None]],
        shutdown_timeout_s: float,
    ) -> None:
        super().__init__(config)
        self.abort_in_flight = abort_in_flight
        self.shutdown_timeout_s = shutdown_timeout_s
        self.abort_requested = False
        self.aborted_in_flight = False
        self.interrupted = False

    def handle_exit(self, sig: int, frame: object) -> None:
        if self.should_exit:  # a second signal: stop waiting for in-flight requests
            self.abort_requested = True
            return
        self.should_exit = True
        self.interrupted = sig == signal.SIGINT

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # Signals can only be handled on the main thread (a server run by tests is not).
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        original_handlers = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in original_handlers.items():
                signal.signal(sig, handler)
        if self.interrupted:
            signal.raise_signal(signal.SIGINT)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        watcher = asyncio.create_task(self._abort_when_due(time.monotonic() + self.shutdown_timeout_s))
        try:
            await super().shutdown(sockets)
        finally:
            watcher.cancel()

    async def _abort_when_due(self, deadline: float) -> None:
        while time.monotonic() < deadline and not self.abort_requested:
            await asyncio.sleep(_POLL_S)
        num_connections = len(self.server_state.connections)
        if num_connections == 0:
            return
        self.aborted_in_flight = True
        logger.warning("shutdown: ending the requests of %d connection(s) still open", num_connections)
        await self.abort_in_flight()
        await asyncio.sleep(_FLUSH_AFTER_ABORT_S)
        self.force_exit = True


def build_server(
    app: FastAPI, config: ServerConfig, abort_in_flight: Callable[[], Awaitable[None]]
) -> DrainingServer:
    """A server for `app` on config.host:config.port; `.run()` blocks until it stops, and
    `abort_in_flight` ends whatever still runs when the shutdown's drain time is up."""
    return DrainingServer(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            loop="uvloop",
            http=NoDelayHttpToolsProtocol,
            ws="none",
            lifespan="on",
            access_log=config.access_log,
            log_config=None,  # keep the process's logging set-up (the CLI's --log-level)
        ),
        abort_in_flight,
        config.shutdown_timeout_s,
    )
