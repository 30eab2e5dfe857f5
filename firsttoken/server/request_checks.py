"""Checks a request passes before any work is done for it: its fields are known (or their
names logged), and its prompt's bytes could fit a request at all."""

from __future__ import annotations

import logging

from firsttoken.engine import AsyncEngine, InvalidInputError
from firsttoken.server.protocol import GenerationRequest

logger = logging.getLogger(__name__)

_MAX_LOGGED_NAMES = 64  # a client sending ever-new names must not grow the set without bound
_MAX_NAME_CHARS = 80


class RequestChecks:
    """The server's cheap up-front checks. Owns the longest token's byte count (no token covers
    more, so a prompt's bytes bound its token count from below) and the unknown field names
    already logged."""

    def __init__(self, engine: AsyncEngine, strict_fields: bool) -> None:
        self.max_request_tokens = engine.max_request_tokens
        self.max_token_bytes = engine.tokenizer.longest_token_bytes()
        self.strict_fields = strict_fields
        self._logged_names: set[str] = set()

    def check_fields(self, body: GenerationRequest) -> None:
        """Refuse a field the API does not define (strict), or log each new name once at debug."""
        for name in body.unknown_fields():
            if self.strict_fields:
                raise InvalidInputError(name[:_MAX_NAME_CHARS], "is not a known field")
            if name not in self._logged_names and len(self._logged_names) < _MAX_LOGGED_NAMES:
                self._logged_names.add(name)
                logger.debug("ignoring the unknown request field %r", name[:_MAX_NAME_CHARS])

    def check_prompt_bytes(self, field: str, texts: list[str]) -> None:
        """Refuse text whose bytes alone prove it too long, before the tokenizer spends time on it."""
        num_bytes = sum(len(text.encode("utf-8")) for text in texts)
        min_tokens = -(-num_bytes // self.max_token_bytes)
        if min_tokens >= self.max_request_tokens:
            raise InvalidInputError(
                field,
                f"{num_bytes} bytes make at least {min_tokens} tokens, leaving no room for output "
                f"within the {self.max_request_tokens} tokens a request may hold",
            )
