"""POST /v1/chat/completions: a conversation in, the assistant's reply out (streamed or whole)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from firsttoken.engine import EngineClient
from firsttoken.outputs import RequestDelta, SampledToken, TokenLogprob
from firsttoken.server.config import ServerConfig
from firsttoken.server.generation import Choice, check_num_choices, sampling_params, start_choices
from firsttoken.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChoiceLogprobs,
    DeltaMessage,
    TopLogprob,
)
from firsttoken.server.protocol import (
    TokenLogprob as TokenLogprobModel,
)
from firsttoken.server.reply import Reply
from firsttoken.server.request_checks import RequestChecks
from firsttoken.server.streaming import respond


async def create_chat_completion(
    engine: EngineClient,
    config: ServerConfig,
    checks: RequestChecks,
    body: ChatCompletionRequest,
    request: Request,
) -> Response:
    checks.check_fields(body)
    check_num_choices(engine, 1, body.n, config.max_choices_per_request)
    messages = [{"role": message.role, "content": message.text()} for message in body.messages]
    checks.check_prompt_bytes("messages", [message["content"] for message in messages])
    prompt = await engine.tokenize(messages=messages)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    requests = [
        (prompt, sampling_params(body, prompt, max_tokens, engine.max_request_tokens, logprobs, index))
        for index in range(body.n)
    ]
    choices = await start_choices(engine, requests, body.priority)
    reply = _ChatReply(config.model_name, engine.tokenizer)
    return await respond(choices, reply, body.stream, body.include_usage, config.retry_after_s, request)


class _ChatReply(Reply):
    """A chat completion's choices: an assistant message, its content streamed as deltas."""

    id_prefix = "chatcmpl"
    chunk_model = ChatCompletionChunk
    response_model = ChatCompletionResponse

    def chunk_choice(self, choice: Choice, delta: RequestDelta) -> ChatChunkChoice:
        """The role goes out with the first content, never alone before it."""
        is_first = choice.num_chunks_sent == 0
        message = DeltaMessage(
            role="assistant" if is_first else None,
            content=delta.text if delta.text or is_first else None,
        )
        return ChatChunkChoice(
            index=choice.index,
            delta=message,
            logprobs=self._logprobs(delta.logprobs),
            finish_reason=delta.finish_reason,
        )

    def whole_choice(self, choice: Choice) -> ChatChoice:
        return ChatChoice(
            index=choice.index,
            message=AssistantMessage(content=choice.output.text),
            logprobs=self._logprobs(choice.output.logprobs),
            finish_reason=choice.output.finish_reason,
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
        return TopLogprob(
            token=self.token_text(token.token_id),
            logprob=token.logprob,
            bytes=list(self.tokenizer.token_bytes(token.token_id)),
        )
