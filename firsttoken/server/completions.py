"""POST /v1/completions: prompts in, text completions out (streamed or whole)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from firsttoken.engine import AsyncEngine, InvalidInputError, TokenizedPrompt
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
from firsttoken.server.streaming import respond


async def create_completion(
    engine: AsyncEngine, config: ServerConfig, body: CompletionRequest, request: Request
) -> Response:
    prompts = await _tokenize_prompts(engine, body, config.max_choices_per_request)
    requests = [
        (
            prompt,
            sampling_params(body, prompt, body.max_tokens, engine.max_request_tokens, body.logprobs, index),
        )
        for prompt in prompts
        for index in range(body.n)
    ]
    choices = await start_choices(engine, requests, body.priority)
    reply = _CompletionReply(config.model_name, engine.tokenizer)
    return await respond(choices, reply, body.stream, body.include_usage, config.retry_after_s, request)


async def _tokenize_prompts(
    engine: AsyncEngine, body: CompletionRequest, max_choices: int
) -> list[TokenizedPrompt]:
    """One TokenizedPrompt per prompt: text, token ids, or a list of either; none may be empty."""
    prompt = body.prompt
    is_one_prompt = isinstance(prompt, str) or (bool(prompt) and isinstance(prompt[0], int))
    prompts = [prompt] if is_one_prompt else prompt
    if not prompts or not all(prompts):
        raise InvalidInputError("prompt", "must not be empty")
    check_num_choices(engine, len(prompts), body.n, max_choices)
    return [await engine.tokenize(item) for item in prompts]


class _CompletionReply(Reply):
    """A completion's choices: text, one object for a chunk and for the whole response."""

    id_prefix = "cmpl"
    chunk_model = CompletionResponse
    response_model = CompletionResponse

    def chunk_choice(self, choice: Choice, delta: RequestDelta) -> CompletionChoice:
        text_start = len(choice.output.text) - len(delta.text)
        return CompletionChoice(
            index=choice.index,
            text=delta.text,
            logprobs=self._logprobs(delta.logprobs, text_start),
            finish_reason=delta.finish_reason,
        )

    def whole_choice(self, choice: Choice) -> CompletionChoice:
        return CompletionChoice(
            index=choice.index,
            text=choice.output.text,
            logprobs=self._logprobs(choice.output.logprobs, 0),
            finish_reason=choice.output.finish_reason,
        )

    def _logprobs(self, sampled: list[SampledToken] | None, text_start: int) -> CompletionLogprobs | None:
        """OpenAI's legacy shape; text_offset counts the decoded token strings from `text_start`."""
        if sampled is None:
            return None
        tokens = [self.token_text(token.token_id) for token in sampled]
        offsets = []
        for token_text in tokens:
            offsets.append(text_start)
            text_start += len(token_text)
        return CompletionLogprobs(
            tokens=tokens,
            token_logprobs=[token.logprob for token in sampled],
            top_logprobs=[
                {self.token_text(top.token_id): top.logprob for top in token.top_logprobs or ()}
                for token in sampled
            ],
            text_offset=offsets,
        )
