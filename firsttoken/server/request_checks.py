"""Checks a request passes before any work is done for it: its fields are known (or named in a
warning), and its prompt's bytes could fit a request at all."""

from __future__ import annotations

import logging

from firsttoken.arithmetic import ceil_div
from firsttoken.engine import EngineClient, InvalidInputError
from firsttoken.server.protocol import RequestBody

logger = logging.getLogger(__name__)

# A hostile request's names must not make a huge log line.
_MAX_NAMES_LOGGED = 16
_MAX_NAME_CHARS = 80


class RequestChecks:
    """The server's cheap up-front checks. Owns the longest token's byte count (no token covers
    more, so a prompt's bytes bound its token count from below)."""

    def __init__(self, engine: EngineClient, strict_fields: bool) -> None:
        self.max_request_tokens = engine.max_request_tokens
        self.max_model_len = engine.max_model_len
        self.max_token_bytes = engine.tokenizer.longest_token_bytes()
        self.strict_fields = strict_fields

    def check_fields(self, body: RequestBody) -> None:
        """Refuse fields the API does not define (strict), or name them in one warning per
        request (as vLLM does): a client must be able to see what it sent had no effect."""
        names = [name[:_MAX_NAME_CHARS] for name in body.unknown_fields()]
        if not names:
            return
        if self.strict_fields:
            raise InvalidInputError(names[0], "is not a known field")
        shown = ", ".join(repr(name) for name in names[:_MAX_NAMES_LOGGED])
        more = f" and {len(names) - _MAX_NAMES_LOGGED} more" if len(names) > _MAX_NAMES_LOGGED else ""
        logger.warning("ignoring request fields the API does not define: %s%s", shown, more)

    def check_tokenizable_bytes(self, field: str, texts: list[str]) -> None:
        """Refuse text for /tokenize whose bytes alone prove it longer than any prompt here (a
        multi-megabyte body would hold a tokenizer thread for seconds, to count for nothing)."""
        num_bytes = sum(len(text.encode("utf-8")) for text in texts)
        min_tokens = ceil_div(num_bytes, self.max_token_bytes)
        if min_tokens > self.max_model_len:
            raise InvalidInputError(
                field,
                f"{num_bytes} bytes make at least {min_tokens} tokens, more than max_model_len "
                f"({self.max_model_len})",
            )

    def check_prompt_bytes(self, field: str, texts: list[str]) -> None:
        """Refuse text whose bytes alone prove it too long, before the tokenizer spends time on it."""
        num_bytes = sum(len(text.encode("utf-8")) for text in texts)
        min_tokens = ceil_div(num_bytes, self.max_token_bytes)
        if min_tokens >= self.max_request_tokens:
            raise InvalidInputError(
                field,
                f"{num_bytes} bytes make at least {min_tokens} tokens, leaving no room for output "
                f"within the {self.max_request_tokens} tokens a request may hold",
            )
