"""A keep-alive HTTP/1.1 connection over a plain socket, so a test can tell whether the server
kept the very connection that carried a hostile request."""

from __future__ import annotations

import socket
from dataclasses import dataclass

import orjson


@dataclass
class WireResponse:
    """A response as read off the socket: status, lower-cased headers, body."""

    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> dict:
        return orjson.loads(self.body)

    @property
    def closes_connection(self) -> bool:
        return self.headers.get("connection", "").lower() == "close"


class WireConnection:
    """One TCP connection to the server; requests go out one after another on it."""

    def __init__(self, base_url: str, timeout_s: float = 60) -> None:
        host, port = base_url.removeprefix("http://").rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=timeout_s)
        self.buffer = b""

    def close(self) -> None:
        self.sock.close()

    def request(
        self, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None
    ) -> WireResponse:
        lines = [f"{method} {path} HTTP/1.1", "Host: test", f"Content-Length: {len(body)}"]
        lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
        self.sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
        return self._read_response(method)

    def _read_response(self, method: str) -> WireResponse:
        head = self._read_until(b"\r\n\r\n")
        status_line, *header_lines = head.decode("latin-1").split("\r\n")
        headers = {}
        for line in header_lines:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        length = 0 if method == "HEAD" else int(headers.get("content-length", "0"))
        return WireResponse(int(status_line.split(" ")[1]), headers, self._read_exactly(length))

    def _read_until(self, marker: bytes) -> bytes:
        while marker not in self.buffer:
            self._receive()
        head, self.buffer = self.buffer.split(marker, 1)
        return head

    def _read_exactly(self, num_bytes: int) -> bytes:
        while len(self.buffer) < num_bytes:
            self._receive()
        data, self.buffer = self.buffer[:num_bytes], self.buffer[num_bytes:]
        return data

    def _receive(self) -> None:
        chunk = self.sock.recv(65536)
        if not chunk:
            raise ConnectionError("the server closed the connection")
        self.buffer += chunk
