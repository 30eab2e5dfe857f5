"""POST /v1/completions: prompts in, text completions out (streamed or whole)."""

from __future__ import annotations

import time
import uuid

from starlette.requests import Request
from starlette.responses import Response

from firsttoken.engine import AsyncEngine, InvalidInputError, TokenizedPrompt, Tokenizer
from firsttoken.outputs import RequestDelta, SampledToken
from firsttoken.server.config import ServerConfig
from firsttoken.server.generation import (
    Choice,
    sampling_params,
    start_choices,
    ttft_extension,
    usage,
)
from firsttoken.server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    FirstTokenExtension,
    Usage,
)
from firsttoken.server.streaming import respond


async def create_completion(
    engine: AsyncEngine, config: ServerConfig, body: CompletionRequest, request: Request
) -> Response:
    prompts = await _tokenize_prompts(engine, body)
    requests = [
        (
            prompt,
            sampling_params(body, prompt, body.max_tokens, engine.max_request_tokens, body.logprobs, index),
        )
        for prompt in prompts
        for index in range(body.n)
    ]
    choices = await start_choices(engine, requests, body.priority)
    reply = _CompletionReply(
        f"cmpl-{uuid.uuid4().hex}", int(time.time()), config.model_name, engine.tokenizer
    )
    return await respond(choices, reply, body.stream, body.include_usage, config.retry_after_s, request)


async def _tokenize_prompts(engine: AsyncEngine, body: CompletionRequest) -> list[TokenizedPrompt]:
    """One TokenizedPrompt per prompt: text, token ids, or a list of either; none may be empty."""
    prompt = body.prompt
    is_one_prompt = isinstance(prompt, str) or (bool(prompt) and isinstance(prompt[0], int))
    prompts = [prompt] if is_one_prompt else prompt
    if not prompts or not all(prompts):
        raise InvalidInputError("prompt", "must not be empty")
    return [await engine.tokenize(item) for item in prompts]


class _CompletionReply:
    """Builds the chunks and the whole response of one completion request."""

    def __init__(self, response_id: str, created: int, model: str, tokenizer: Tokenizer) -> None:
        self.response_id = response_id
        self.created = created
        self.model = model
        self.tokenizer = tokenizer

    def chunk(
        self, choice: Choice, delta: RequestDelta, extension: FirstTokenExtension | None
    ) -> CompletionResponse | None:
        if not delta.text and not delta.finished and delta.logprobs is None:
            return None
        text_start = len(choice.output.text) - len(delta.text)
        return CompletionResponse(
            id=self.response_id,
            created=self.created,
            model=self.model,
            choices=[
                CompletionChoice(
                    index=choice.index,
                    text=delta.text,
                    logprobs=self._logprobs(delta.logprobs, text_start),
                    finish_reason=delta.finish_reason,
                )
            ],
            firsttoken=extension,
        )

    def usage_chunk(self, total: Usage, extension: FirstTokenExtension) -> CompletionResponse:
        return CompletionResponse(
            id=self.response_id,
            created=self.created,
            model=self.model,
            choices=[],
            usage=total,
            firsttoken=extension,
        )

    def whole(self, choices: list[Choice]) -> CompletionResponse:
        return CompletionResponse(
            id=self.response_id,
            created=self.created,
            model=self.model,
            choices=[
                CompletionChoice(
                    index=choice.index,
                    text=choice.output.text,
                    logprobs=self._logprobs(choice.output.logprobs, 0),
                    finish_reason=choice.output.finish_reason,
                )
                for choice in choices
            ],
            usage=usage(choices),
            firsttoken=ttft_extension(choices),
        )

    def _logprobs(self, sampled: list[SampledToken] | None, text_start: int) -> CompletionLogprobs | None:
        """OpenAI's legacy shape; text_offset counts the decoded token strings from `text_start`."""
        if sampled is None:
            return None
        tokens = [self._token_text(token.token_id) for token in sampled]
        offsets = []
        for token_text in tokens:
            offsets.append(text_start)
            text_start += len(token_text)
        return CompletionLogprobs(
            tokens=tokens,
            token_logprobs=[token.logprob for token in sampled],
            top_logprobs=[
                {self._token_text(top.token_id): top.logprob for top in token.top_logprobs or ()}
                for token in sampled
            ],
            text_offset=offsets,
        )

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)
