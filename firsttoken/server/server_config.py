"""ServerConfig: how the OpenAI-compatible server listens, whom it serves and what it accepts."""

from __future__ import annotations

import os
from dataclasses import dataclass

from firsttoken.limits import MAX_SECONDS
from firsttoken.engine import InvalidInputError


@dataclass(frozen=True)
class JSONLimits:
    """How much structure a JSON request body may hold, and which bodies are parsed off the loop."""

    # Values (numbers, strings, arrays, objects) one body may hold; parsing cost grows with
    # this count, not with bytes. Room for a prompt of this many token ids.
    max_values: int = 1 << 17
    # Bodies up to this many bytes are parsed on the event loop; larger ones on a thread.
    inline_parse_bytes: int = 64 * 1024

    def __post_init__(self) -> None:
        if self.max_values < 1:
            raise InvalidInputError("max_json_values", f"must be >= 1, got {self.max_values}")
        if self.inline_parse_bytes < 0:
            raise InvalidInputError("inline_parse_bytes", f"must be >= 0, got {self.inline_parse_bytes}")


@dataclass(frozen=True)
class ServerConfig:
    """The HTTP side's settings; the engine's own live in EngineConfig."""

    host: str = "127.0.0.1"
    port: int = 8000
    # Names clients may put in `model`; the first is the one /v1/models and replies show.
    served_model_names: tuple[str, ...] = ("firsttoken",)
    # Bearer token every /v1 request must carry; None serves without authentication.
    api_key: str | None = None
    # Larger request bodies get 413 before they are parsed.
    max_request_bytes: int = 4 * 1024 * 1024
    # Seconds a client told "queue full" (429) should wait before retrying.
    retry_after_s: int = 1
    json_limits: JSONLimits = JSONLimits()
    # Choices (prompts x n) one request may ask for; each is an engine request.
    max_choices_per_request: int = 128
    # Refuse request fields the API does not define (400) instead of ignoring them.
    strict_fields: bool = False
    # Browser origins allowed to call the API (CORS; "*" for any); empty: no CORS headers.
    allowed_origins: tuple[str, ...] = ()
    # Seconds a shutdown waits for in-flight requests before ending them with an error.
    shutdown_timeout_s: float = 30.0
    # Seconds between the SSE comments a stream sends until its first chunk (while it queues
    # and prefills), so that a client's read timeout does not end it.
    stream_keepalive_s: float = 15.0
    access_log: bool = False
    # Serve the chat page at `/` (static files of the package; it talks to /v1 like any client).
    web_ui: bool = True

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise InvalidInputError("port", f"must be in [0, 65535], got {self.port}")
        if not self.served_model_names or not all(self.served_model_names):
            raise InvalidInputError("served_model_names", "give at least one non-empty name")
        if self.api_key is not None and not self.api_key:
            raise InvalidInputError("api_key", "must not be empty (omit it to serve without a key)")
        if self.max_request_bytes < 1:
            raise InvalidInputError("max_request_bytes", f"must be >= 1, got {self.max_request_bytes}")
        if self.max_choices_per_request < 1:
            raise InvalidInputError(
                "max_choices_per_request", f"must be >= 1, got {self.max_choices_per_request}"
            )
        # A range, not `< 0`: nan passes that, and then every drain ends at once.
        if not 0 <= self.shutdown_timeout_s <= MAX_SECONDS:
            raise InvalidInputError(
                "shutdown_timeout_s",
                f"must be a finite number in [0, {MAX_SECONDS}] (seconds), got {self.shutdown_timeout_s}",
            )
        if not 0 < self.stream_keepalive_s <= MAX_SECONDS:
            raise InvalidInputError(
                "stream_keepalive_s",
                f"must be a finite number in (0, {MAX_SECONDS}] (seconds), got {self.stream_keepalive_s}",
            )
        if self.retry_after_s < 1:
            raise InvalidInputError("retry_after_s", f"must be >= 1, got {self.retry_after_s}")
        if not all(self.allowed_origins):
            raise InvalidInputError("allowed_origins", "every origin must be non-empty")

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]


def default_model_name(model_path: str) -> str:
    """The name a model is served under without --served-model-name: its file's (no .gguf)."""
    return os.path.basename(os.path.normpath(model_path)).removesuffix(".gguf")
