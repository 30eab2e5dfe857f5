"""What the chat and the completions replies share: the envelope of every chunk and of the whole
response (id, creation time, model, usage, the TTFT extension), and the text of one token."""

from __future__ import annotations

import time
import uuid
from abc import ABC, abstractmethod
from typing import Any, ClassVar

from pydantic import BaseModel

from firsttoken.engine import Tokenizer
from firsttoken.outputs import RequestDelta, SampledToken
from firsttoken.server.generation import Choice, Generation
from firsttoken.server.protocol import FirstTokenExtension, PromptLogprob, PromptLogprobs, Usage


class Reply(ABC):
    """Builds the stream chunks and the whole response of one request; owns the response's id,
    creation time and model name, which every chunk repeats. An endpoint says how a choice looks."""

    id_prefix: ClassVar[str]
    chunk_model: ClassVar[type[BaseModel]]
    response_model: ClassVar[type[BaseModel]]

    def __init__(self, model: str, tokenizer: Tokenizer) -> None:
        self.response_id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.tokenizer = tokenizer

    @abstractmethod
    def chunk_choice(self, choice: Choice, delta: RequestDelta) -> BaseModel | None:
        """What `delta` adds to `choice`, as its part of a stream chunk; None when it shows
        nothing yet (text held back by a tool-call parser)."""

    @abstractmethod
    def whole_choice(self, choice: Choice) -> BaseModel:
        """A finished choice, as its part of the whole response."""

    def chunk(
        self, choice: Choice, delta: RequestDelta, extension: FirstTokenExtension | None
    ) -> BaseModel | None:
        """The chunk of `delta` (`extension` when it is the response's last), or None while it
        has nothing to show (text held back by a stop string, no logprobs asked)."""
        if not delta.text and not delta.finished and delta.logprobs is None:
            return None
        choice_part = self.chunk_choice(choice, delta)
        if choice_part is None:
            return None
        return self.chunk_model(**self._envelope(), choices=[choice_part], firsttoken=extension)

    def usage_chunk(self, total: Usage, extension: FirstTokenExtension) -> BaseModel:
        return self.chunk_model(**self._envelope(), choices=[], usage=total, firsttoken=extension)

    def whole(self, generation: Generation) -> BaseModel:
        return self.response_model(
            **self._envelope(),
            choices=[self.whole_choice(choice) for choice in generation.choices],
            usage=generation.usage(),
            firsttoken=generation.ttft_extension(),
        )

    def token_text(self, token_id: int) -> str:
        """One token as logprobs name it: its own text, special tokens included. A token holding
        part of a UTF-8 character shows those bytes escaped (`\\xe2\\x80`), as OpenAI does."""
        return self.tokenizer.token_bytes(token_id).decode("utf-8", "backslashreplace")

    def prompt_logprobs(
        self, scored: list[SampledToken | None] | None, num_top: int | None
    ) -> PromptLogprobs | None:
        """vLLM's shape: per prompt token (the first None), the token and its `num_top`
        likeliest alternatives, by token id."""
        if scored is None or num_top is None:
            return None
        return [None if token is None else self._prompt_logprob_entry(token, num_top) for token in scored]

    def _prompt_logprob_entry(self, token: SampledToken, num_top: int) -> dict[int, PromptLogprob]:
        assert token.logprob is not None  # scored prompt tokens always carry theirs
        entry = {token.token_id: PromptLogprob(logprob=token.logprob, rank=token.rank,
                                               decoded_token=self.token_text(token.token_id))}
        for rank, alternative in enumerate((token.top_logprobs or [])[:num_top], start=1):
            entry.setdefault(alternative.token_id, PromptLogprob(
                logprob=alternative.logprob, rank=rank, decoded_token=self.token_text(alternative.token_id)
            ))
        return entry

    def _envelope(self) -> dict[str, Any]:
        return {"id": self.response_id, "created": self.created, "model": self.model}
