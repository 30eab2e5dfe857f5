"""POST /v1/chat/completions: a conversation in, the assistant's reply out (streamed or whole)."""

from __future__ import annotations

import time
import uuid

from starlette.requests import Request
from starlette.responses import Response

from firsttoken.engine import AsyncEngine, Tokenizer
from firsttoken.outputs import RequestDelta, SampledToken, TokenLogprob
from firsttoken.server.config import ServerConfig
from firsttoken.server.generation import (
    Choice,
    sampling_params,
    start_choices,
    ttft_extension,
    usage,
)
from firsttoken.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChoiceLogprobs,
    DeltaMessage,
    FirstTokenExtension,
    TopLogprob,
    Usage,
)
from firsttoken.server.protocol import (
    TokenLogprob as TokenLogprobModel,
)
from firsttoken.server.streaming import respond


async def create_chat_completion(
    engine: AsyncEngine, config: ServerConfig, body: ChatCompletionRequest, request: Request
) -> Response:
    messages = [{"role": message.role, "content": message.text()} for message in body.messages]
    prompt = await engine.tokenize(messages=messages)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    requests = [
        (prompt, sampling_params(body, prompt, max_tokens, engine.max_request_tokens, logprobs, index))
        for index in range(body.n)
    ]
    choices = await start_choices(engine, requests, body.priority)
    reply = _ChatReply(f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), config.model_name, engine.tokenizer)
    return await respond(choices, reply, body.stream, body.include_usage, config.retry_after_s, request)


class _ChatReply:
    """Builds the chunks and the whole response of one chat completion request."""

    def __init__(self, response_id: str, created: int, model: str, tokenizer: Tokenizer) -> None:
        self.response_id = response_id
        self.created = created
        self.model = model
        self.tokenizer = tokenizer

    def chunk(
        self, choice: Choice, delta: RequestDelta, extension: FirstTokenExtension | None
    ) -> ChatCompletionChunk | None:
        """The role goes out with the first content, never alone before it."""
        if not delta.text and not delta.finished and delta.logprobs is None:
            return None
        is_first = choice.num_chunks_sent == 0
        message = DeltaMessage(
            role="assistant" if is_first else None,
            content=delta.text if delta.text or is_first else None,
        )
        return ChatCompletionChunk(
            id=self.response_id,
            created=self.created,
            model=self.model,
            choices=[
                ChatChunkChoice(
                    index=choice.index,
                    delta=message,
                    logprobs=self._logprobs(delta.logprobs),
                    finish_reason=delta.finish_reason,
                )
            ],
            firsttoken=extension,
        )

    def usage_chunk(self, total: Usage, extension: FirstTokenExtension) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.response_id,
            created=self.created,
            model=self.model,
            choices=[],
            usage=total,
            firsttoken=extension,
        )

    def whole(self, choices: list[Choice]) -> ChatCompletionResponse:
        return ChatCompletionResponse(
            id=self.response_id,
            created=self.created,
            model=self.model,
            choices=[
                ChatChoice(
                    index=choice.index,
                    message=AssistantMessage(content=choice.output.text),
                    logprobs=self._logprobs(choice.output.logprobs),
                    finish_reason=choice.output.finish_reason,
                )
                for choice in choices
            ],
            usage=usage(choices),
            firsttoken=ttft_extension(choices),
        )

    def _logprobs(self, sampled: list[SampledToken] | None) -> ChoiceLogprobs | None:
        if sampled is None:
            return None
        content = []
        for token in sampled:
            top = self._top_logprob(TokenLogprob(token.token_id, token.logprob))
            alternatives = [self._top_logprob(alternative) for alternative in token.top_logprobs or ()]
            content.append(
                TokenLogprobModel(
                    token=top.token, logprob=top.logprob, bytes=top.bytes, top_logprobs=alternatives
                )
            )
        return ChoiceLogprobs(content=content)

    def _top_logprob(self, token: TokenLogprob) -> TopLogprob:
        text = self.tokenizer.decode([token.token_id], skip_special_tokens=False)
        return TopLogprob(token=text, logprob=token.logprob, bytes=list(text.encode("utf-8")))
