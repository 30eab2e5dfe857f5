"""POST /v1/completions: prompts in, text completions out (streamed or whole)."""

from __future__ import annotations

import codecs

from starlette.requests import Request
from starlette.responses import Response

from firsttoken.engine import EngineClient, InvalidInputError, Tokenizer
from firsttoken.outputs import RequestDelta, SampledToken
from firsttoken.server.config import ServerConfig
from firsttoken.server.generation import Choice, check_num_choices, sampling_params, start_choices
from firsttoken.server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from firsttoken.server.reply import Reply
from firsttoken.server.request_checks import RequestChecks
from firsttoken.server.streaming import respond


_ENGINE_PROMPT_FIELD = "prompt_token_ids"


async def create_completion(
    engine: EngineClient,
    config: ServerConfig,
    checks: RequestChecks,
    body: CompletionRequest,
    request: Request,
) -> Response:
    checks.check_fields(body)
    items = _prompt_items(body)
    check_num_choices(engine, len(items), body.n, config.max_choices_per_request)
    for index, item in enumerate(items):
        if isinstance(item, str):
            checks.check_prompt_bytes("prompt" if len(items) == 1 else f"prompt[{index}]", [item])
    prompts = [await engine.tokenize(item) for item in items]
    requests = [
        (
            prompt,
            sampling_params(body, prompt, body.max_tokens, engine.max_request_tokens, body.logprobs, index),
        )
        for prompt in prompts
        for index in range(body.n)
    ]
    try:
        choices = await start_choices(engine, requests, body.priority)
    except InvalidInputError as error:
        if error.field != _ENGINE_PROMPT_FIELD:
            raise
        raise InvalidInputError("prompt", str(error)) from error  # the client knows it as `prompt`
    prompt_lengths = _prompt_lengths(engine, items) if body.logprobs is not None else [0] * len(items)
    reply = _CompletionReply(
        config.model_name, engine.tokenizer, [length for length in prompt_lengths for _ in range(body.n)]
    )
    return await respond(choices, reply, body.stream, body.include_usage, config.retry_after_s, request)


def _prompt_items(body: CompletionRequest) -> list[str | list[int]]:
    """The prompts of a request: text, token ids, or a list of either; none may be empty."""
    prompt = body.prompt
    is_one_prompt = isinstance(prompt, str) or (bool(prompt) and isinstance(prompt[0], int))
    items = [prompt] if is_one_prompt else prompt
    if not items or not all(items):
        raise InvalidInputError("prompt", "must not be empty")
    return items


def _prompt_lengths(engine: EngineClient, items: list[str | list[int]]) -> list[int]:
    """Each prompt's length in characters, where logprobs' text_offset of its first generated
    token lies (OpenAI counts offsets from the prompt's start); token ids count as their text."""
    return [len(item) if isinstance(item, str) else len(engine.tokenizer.decode(item)) for item in items]


class _CompletionReply(Reply):
    """A completion's choices: text, one object for a chunk and for the whole response."""

    id_prefix = "cmpl"
    chunk_model = CompletionResponse
    response_model = CompletionResponse

    def __init__(self, model: str, tokenizer: Tokenizer, prompt_lengths: list[int]) -> None:
        super().__init__(model, tokenizer)
        self.prompt_lengths = prompt_lengths  # per choice index, in characters

    def chunk_choice(self, choice: Choice, delta: RequestDelta) -> CompletionChoice:
        text_start = len(choice.output.text) - len(delta.text)
        return CompletionChoice(
            index=choice.index,
            text=delta.text,
            logprobs=self._logprobs(delta.logprobs, self.prompt_lengths[choice.index] + text_start),
            finish_reason=delta.finish_reason,
        )

    def whole_choice(self, choice: Choice) -> CompletionChoice:
        return CompletionChoice(
            index=choice.index,
            text=choice.output.text,
            logprobs=self._logprobs(choice.output.logprobs, self.prompt_lengths[choice.index]),
            finish_reason=choice.output.finish_reason,
        )

    def _logprobs(self, sampled: list[SampledToken] | None, text_start: int) -> CompletionLogprobs | None:
        """OpenAI's legacy shape; text_offset: where each token starts, in characters, the first
        at `text_start`."""
        if sampled is None:
            return None
        pieces = [self.tokenizer.token_bytes(token.token_id) for token in sampled]
        return CompletionLogprobs(
            tokens=[self.token_text(token.token_id) for token in sampled],
            token_logprobs=[token.logprob for token in sampled],
            top_logprobs=[
                {self.token_text(top.token_id): top.logprob for top in token.top_logprobs or ()}
                for token in sampled
            ],
            text_offset=text_offsets(pieces, text_start),
        )


def text_offsets(pieces: list[bytes], text_start: int) -> list[int]:
    """Where each token's text starts, in characters from `text_start`. A character split across
    tokens starts with its first token, so a token that only completes it shares that offset."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    offsets = []
    for piece in pieces:
        offsets.append(text_start)
        text_start += len(decoder.decode(piece))
    return offsets
