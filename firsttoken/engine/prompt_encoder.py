"""PromptEncoder: prompts and chat messages to token ids off the event loop, with arrival stamped.

Shared by every front end that tokenizes: AsyncEngine beside its engine, and a router in front
of engine replicas, which must hash the same tokens the replicas' prefix caches hold.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence, TypeVar, Union

import jinja2

from firsttoken.errors import InvalidInputError
from firsttoken.tokenizer import Tokenizer

Messages = Sequence[dict[str, Any]]
TextOrTokenIds = Union[str, Sequence[int]]
Result = TypeVar("Result")


@dataclass(frozen=True)
class TokenizedPrompt:
    """A prompt's token ids, with when it arrived and when tokenizing ended (perf_counter s)."""

    token_ids: list[int]
    arrival_time: float
    tokenized_time: float


class PromptEncoder:
    """Owns the threads a tokenizer encodes and decodes on, so that the event loop never waits;
    other per-request preparation (compiling a structured-output grammar) runs on them too."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="firsttoken-tokenize")

    async def tokenize(
        self,
        prompt: TextOrTokenIds | None = None,
        *,
        messages: Messages | None = None,
        add_generation_prompt: bool = True,
        add_special_tokens: bool = True,
        chat_template_args: dict[str, Any] | None = None,
    ) -> TokenizedPrompt:
        """Stamp arrival, then render the chat template (for `messages`, with the keyword
        arguments `chat_template_args` of Tokenizer.apply_chat_template) and encode, timed.

        Text is encoded on the tokenizer threads: `tokenizers` releases the GIL while encoding,
        so a long prompt never stalls the event loop, and its encode/decode are safe to call
        concurrently (tests/engine/test_async_engine.py checks both claims).
        """
        arrival_time = time.perf_counter()
        if (prompt is None) == (messages is None):
            raise InvalidInputError("prompt", "give either a prompt or messages")
        if messages is None and not isinstance(prompt, str):
            token_ids = list(prompt)
        else:
            encode = functools.partial(self._encode, chat_template_args=chat_template_args or {})
            token_ids = await self.run(encode, prompt, messages, add_generation_prompt, add_special_tokens)
        return TokenizedPrompt(token_ids, arrival_time, time.perf_counter())

    async def run(self, function: Callable[..., Result], *args: Any) -> Result:
        """`function(*args)` on the tokenizer threads."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, function, *args)

    def submit(self, function: Callable[[], Any]) -> concurrent.futures.Future:
        """Start `function()` on the tokenizer threads without waiting for it."""
        return self._pool.submit(function)

    async def detokenize(self, token_ids: Sequence[int]) -> str:
        """The text of token ids (special tokens included), decoded on the tokenizer threads."""
        for token_id in token_ids:
            if not 0 <= token_id < self.vocab_size:
                raise InvalidInputError(
                    "token_ids", f"{token_id} is not a token id in [0, {self.vocab_size})"
                )
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self.tokenizer.decode, token_ids, False)

    async def encode_system_prompt(self, system_prompt: str) -> list[int]:
        """The token ids of a system message's chat-template rendering (what a pin holds)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self._encode_system_prompt, system_prompt)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _encode_system_prompt(self, system_prompt: str) -> list[int]:
        try:
            return self.tokenizer.encode(render_system_prompt(self.tokenizer, system_prompt))
        except jinja2.TemplateError as error:
            raise InvalidInputError("system_prompt", f"the chat template failed: {error}") from error

    def _encode(
        self,
        prompt: str | None,
        messages: Messages | None,
        add_generation_prompt: bool,
        add_special_tokens: bool,
        chat_template_args: dict[str, Any],
    ) -> list[int]:
        if messages is not None:
            try:
                prompt = self.tokenizer.apply_chat_template(
                    messages, add_generation_prompt, **chat_template_args
                )
            except jinja2.TemplateError as error:  # a model's template refusing this conversation
                raise InvalidInputError("messages", f"the chat template failed: {error}") from error
        if not prompt:
            raise InvalidInputError("prompt", "must not be empty")
        return self.tokenizer.encode(prompt, add_special_tokens)


def render_system_prompt(tokenizer: Tokenizer, system_prompt: str) -> str:
    """The chat-template rendering of a system message alone: the prefix of every conversation
    that starts with it."""
    return tokenizer.apply_chat_template(
        [{"role": "system", "content": system_prompt}], add_generation_prompt=False
    )
