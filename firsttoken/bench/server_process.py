"""A server process on a local port (a free one unless given): `firsttoken serve` with given
engine options, for benchmarks that compare server settings (`firsttoken tune`), or any
OpenAI-compatible server's command (a peer's, to measure it beside firsttoken)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any, Self

import httpx

from firsttoken.engine_args import engine_flags


LOOPBACK = "127.0.0.1"
# Listening on these is listening on every interface: a client here reaches the server over the loopback.
_WILDCARD_HOSTS = ("0.0.0.0", "::", "")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind((LOOPBACK, 0))
        return probe.getsockname()[1]


def client_url(host: str, port: int) -> str:
    """The URL this machine reaches a server listening on `host`:`port` at."""
    reached = LOOPBACK if host in _WILDCARD_HOSTS else host
    return f"http://[{reached}]:{port}" if ":" in reached else f"http://{reached}:{port}"


class LocalServer:
    """Owns one server process on a local port (`port`, else a free one): started on entry
    (returns once /health answers), stopped on exit with every process it started (it leads a
    process group of its own, so a server's engine processes go with it)."""

    def __init__(
        self,
        command_for_port: Callable[[int], list[str]],
        environment: dict[str, str] | None = None,
        start_timeout_s: float = 900.0,
        host: str = LOOPBACK,
        port: int | None = None,
    ) -> None:
        self.port = free_port() if port is None else port
        self.base_url = client_url(host, self.port)
        self.command = command_for_port(self.port)
        self.environment = {**(environment or os.environ), "PYTHONUNBUFFERED": "1"}
        self.start_timeout_s = start_timeout_s
        self._log = tempfile.TemporaryFile(mode="w+")
        self._process: subprocess.Popen | None = None

    def __enter__(self) -> Self:
        self._process = subprocess.Popen(
            self.command, stdout=self._log, stderr=subprocess.STDOUT, env=self.environment,
            start_new_session=True,
        )  # fmt: skip
        self._wait_until_healthy()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.stop()

    def stop(self) -> None:
        process = self._process
        if process is not None and process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        self._log.close()

    def _wait_until_healthy(self) -> None:
        assert self._process is not None
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                message = f"the server exited ({self._process.returncode}): {self._log_tail()}"
                self.stop()
                raise RuntimeError(message)
            try:
                if httpx.get(self.base_url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass  # not listening yet
            time.sleep(0.5)
        message = f"the server did not answer /health within {self.start_timeout_s:g} s: {self._log_tail()}"
        self.stop()
        raise RuntimeError(message)

    def _log_tail(self, num_chars: int = 600) -> str:
        self._log.seek(0)
        return self._log.read()[-num_chars:].strip()


class ServerProcess(LocalServer):
    """A `firsttoken serve` process with the given model and engine options, listening on `host`
    (the loopback unless given) and `port` (a free one unless given)."""

    def __init__(
        self,
        model: str | None,
        options: dict[str, Any],
        start_timeout_s: float = 900.0,
        host: str = LOOPBACK,
        port: int | None = None,
    ) -> None:
        model_flags = ["--model", model] if model else []

        def command_for_port(port: int) -> list[str]:
            return [
                sys.executable, "-m", "firsttoken", "serve", "--host", host, "--port", str(port),
                *model_flags, *engine_flags(options),
            ]  # fmt: skip

        super().__init__(command_for_port, start_timeout_s=start_timeout_s, host=host, port=port)
