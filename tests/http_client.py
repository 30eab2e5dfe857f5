"""The client behind the tests' one-off HTTP requests. httpx's module functions (`httpx.get`)
build a client, and with it an SSL context (~40 ms of CPU), on every call; polling loops made
that seconds per test. A new connection per request, as those functions open, so a request
never meets a connection a stopped server left behind."""

from __future__ import annotations

import httpx

HTTP = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0))
