"""The uvicorn server (uvloop, httptools) that runs the app, with Nagle's algorithm off."""

from __future__ import annotations

import asyncio
import socket

import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from firsttoken.server.config import ServerConfig


class NoDelayHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol that sets TCP_NODELAY on every accepted socket, so a small
    SSE chunk leaves at once instead of waiting for the previous chunk's ACK (Nagle)."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        super().connection_made(transport)


def build_server(app: FastAPI, config: ServerConfig) -> uvicorn.Server:
    """A uvicorn server for `app` on config.host:config.port; `.run()` blocks until it stops."""
    return uvicorn.Server(
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
        )
    )
