"""A `firsttoken serve` process on a free local port, started with given engine options, for
benchmarks that compare server settings (`firsttoken tune`)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from types import TracebackType
from typing import Any

import httpx

from firsttoken.engine_args import engine_flags


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class ServerProcess:
    """Owns one server process: started on entry (returns once /health answers), stopped on exit."""

    def __init__(self, model: str | None, options: dict[str, Any], start_timeout_s: float = 900.0) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        model_flags = ["--model", model] if model else []
        self.command = [
            sys.executable, "-m", "firsttoken", "serve", "--host", "127.0.0.1", "--port", str(self.port),
            *model_flags, *engine_flags(options),
        ]  # fmt: skip
        self.start_timeout_s = start_timeout_s
        self._log = tempfile.TemporaryFile(mode="w+")
        self._process: subprocess.Popen | None = None

    def __enter__(self) -> ServerProcess:
        environment = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self._process = subprocess.Popen(
            self.command, stdout=self._log, stderr=subprocess.STDOUT, env=environment
        )
        self._wait_until_healthy()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.stop()

    def stop(self) -> None:
        process = self._process
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
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
        self.stop()
        raise RuntimeError(f"the server did not answer /health within {self.start_timeout_s:g} s")

    def _log_tail(self, num_chars: int = 600) -> str:
        self._log.seek(0)
        return self._log.read()[-num_chars:].strip()
