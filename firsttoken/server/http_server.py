"""The uvicorn server (uvloop, httptools) that runs the app: Nagle's algorithm off, and a
shutdown that drains in-flight requests for a bounded time, then ends the rest in-band."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import threading
import time
from typing import Awaitable, Callable, Iterator, NoReturn

import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from firsttoken.server.server_config import ServerConfig

logger = logging.getLogger(__name__)

# After in-flight requests were ended at the drain's deadline, how long their error events and
# 503s may take to leave before the server stops waiting for their connections (a client that
# stopped reading); with ending them, within the 1 s past the deadline that a shutdown may take.
_FLUSH_AFTER_ABORT_S = 0.5
# At a second signal: just long enough for the error events already written to leave.
_FLUSH_AFTER_SECOND_SIGNAL_S = 0.1
# Ending the requests fails their streams at once; waiting for the engine's running step to end
# is bounded by this (the engine thread is a daemon and finishes on its own).
_ABORT_WAIT_S = 0.3
_POLL_S = 0.05
# When the exit deadline fires after the first signal: a signalled server process is gone by
# shutdown_timeout_s + 1 s. The rest of the second covers the signal's delivery to the handler and
# the kernel's teardown of a large process with many open connections, which on a busy machine
# takes most of that.
_EXIT_MARGIN_S = 0.4
_EXIT_AFTER_SECOND_SIGNAL_S = 0.5


class ExitDeadline:
    """Owns the last resort of a signalled server process: a daemon timer that ends the process
    if its orderly shutdown (ending requests, closing connections, the interpreter's teardown)
    has not by the deadline, which a busy machine or a stuck client could otherwise stretch."""

    def __init__(self) -> None:
        self._timer: threading.Timer | None = None

    def arm(self, seconds: float, exit_status: int) -> None:
        """Exit with `exit_status` in `seconds` unless the process has exited; replaces any
        deadline armed before."""
        self.cancel()
        self._timer = threading.Timer(seconds, _exit_now, args=(seconds, exit_status))
        self._timer.daemon = True
        self._timer.start()

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()


def _exit_now(seconds: float, exit_status: int) -> None:
    logger.error("shutdown: still running %.1f s after the signal; exiting now", seconds)
    end_process(exit_status)


def end_process(exit_status: int) -> NoReturn:
    """Flush the logs and standard streams and end the process at once, without the
    interpreter's teardown (freeing a model's memory, library finalizers): a served process
    whose engine and connections are closed has nothing left to clean, and that teardown,
    which no deadline bounds once it begins, could outlast the shutdown's."""
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_status)


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
        # Set by a caller that owns the process (`firsttoken serve`), never by one that embeds it.
        self.exit_deadline: ExitDeadline | None = None

    def handle_exit(self, sig: int, frame: object) -> None:
        if self.should_exit:  # a second signal: stop waiting for in-flight requests
            self.abort_requested = True
            self._arm_exit_deadline(_EXIT_AFTER_SECOND_SIGNAL_S)
            return
        self.should_exit = True
        self.interrupted = sig == signal.SIGINT
        self._arm_exit_deadline(self.shutdown_timeout_s + _EXIT_MARGIN_S)

    def _arm_exit_deadline(self, seconds: float) -> None:
        if self.exit_deadline is not None:
            # A forced exit ended requests early: the status a caller gives an aborted drain.
            self.exit_deadline.arm(seconds, 130 if self.interrupted else 1)

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
        if self.force_exit:
            # uvicorn skips the app's shutdown when forced; left pending, the lifespan task would
            # be cancelled at the loop's close and logged as a traceback. The engine's requests
            # are already ended, so this is short; the exit deadline bounds it all the same.
            await self.lifespan.shutdown()

    async def _abort_when_due(self, deadline: float) -> None:
        while time.monotonic() < deadline and not self.abort_requested:
            await asyncio.sleep(_POLL_S)
        num_connections = len(self.server_state.connections)
        if num_connections == 0:
            return
        self.aborted_in_flight = True
        logger.warning("shutdown: ending the requests of %d connection(s) still open", num_connections)
        try:
            await asyncio.wait_for(self.abort_in_flight(), _ABORT_WAIT_S)
        except asyncio.TimeoutError:
            logger.warning("shutdown: not waiting for the engine's running step to end")
        flush_s = _FLUSH_AFTER_SECOND_SIGNAL_S if self.abort_requested else _FLUSH_AFTER_ABORT_S
        flush_deadline = time.monotonic() + flush_s
        while self.server_state.connections and time.monotonic() < flush_deadline:
            await asyncio.sleep(_POLL_S)
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
