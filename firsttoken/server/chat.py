"""POST /v1/chat/completions: a conversation in, the assistant's reply out (streamed or whole)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from starlette.responses import Response

from firsttoken.engine import EngineClient, Tokenizer
from firsttoken.outputs import RequestDelta, SampledToken, TokenLogprob
from firsttoken.server.server_config import ServerConfig
from firsttoken.server.generation import Choice, ChoiceParams, Generation, plan_generation
from firsttoken.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChoiceLogprobs,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    ResponseFunctionCall,
    ResponseToolCall,
    TopLogprob,
)
from firsttoken.server.protocol import (
    TokenLogprob as TokenLogprobModel,
)
from firsttoken.server.reply import Reply
from firsttoken.server.request_checks import RequestChecks
from firsttoken.server.streaming import respond
from firsttoken.server.tool_calls import (
    ToolCallParser,
    forcing_constraint,
    hermes_conversation,
    parse_tool_calls,
)


async def create_chat_completion(
    engine: EngineClient,
    config: ServerConfig,
    checks: RequestChecks,
    body: ChatCompletionRequest,
) -> Response:
    checks.check_fields(body)
    plan = plan_generation(engine, body, 1, config.max_choices_per_request)
    checks.check_prompt_bytes("messages", [message.text() for message in body.messages])
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools] if body.tools else None
    messages, chat_template_args = _template_input(engine.tokenizer, body, tools)
    prompt = await engine.tokenize(messages=messages, chat_template_args=chat_template_args)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    if body.forces_tool_call:
        structured = forcing_constraint(tools, body.forced_function, body.parallel_tool_calls)
    else:
        structured = body.structured_output()
    params = ChoiceParams(max_tokens, logprobs, structured, prompt_logprobs=body.prompt_logprobs)
    generation = await plan.start([prompt], params)
    parses_tool_calls = tools is not None and body.tool_choice_name != "none"
    reply = _ChatReply(
        config.model_name, engine.tokenizer, parses_tool_calls, body.prompt_logprobs, body.parallel_tool_calls
    )
    return await respond(generation, reply, body.stream, body.include_usage, config)


def _template_input(
    tokenizer: Tokenizer, body: ChatCompletionRequest, tools: list[dict[str, Any]] | None
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages and the chat template's keyword arguments: tools go to a template that renders
    them; for one that does not, tools, calls and results are written into the messages in the
    Hermes format (tool_calls.py)."""
    messages = [message.template_message() for message in body.messages]
    uses_tools = tools is not None or any(
        message.role == "tool" or message.tool_calls for message in body.messages
    )
    template = tokenizer.chat_template
    if uses_tools and (template is None or not template.renders_tools):
        messages, tools = hermes_conversation(messages, tools), None
    return messages, {
        "tools": tools,
        "documents": body.documents,
        "template_kwargs": body.chat_template_kwargs,
    }


class _ChatReply(Reply):
    """A chat completion's choices: an assistant message, its content streamed as deltas."""

    id_prefix = "chatcmpl"
    chunk_model = ChatCompletionChunk
    response_model = ChatCompletionResponse

    def __init__(
        self,
        model: str,
        tokenizer: Tokenizer,
        parses_tool_calls: bool,
        num_prompt_logprobs: int | None = None,
        parallel_tool_calls: bool = True,
    ) -> None:
        super().__init__(model, tokenizer)
        self.parses_tool_calls = parses_tool_calls
        self.num_prompt_logprobs = num_prompt_logprobs
        self.parallel_tool_calls = parallel_tool_calls
        self._parsers: dict[int, ToolCallParser] = {}  # by choice index, while streaming

    def chunk_choice(self, choice: Choice, delta: RequestDelta) -> ChatChunkChoice | None:
        """The role goes out with the first content, never alone before it. With tools, text
        that may start a tool call is held back, and each call goes out whole once closed."""
        text, tool_calls, finish_reason = delta.text, None, delta.finish_reason
        if self.parses_tool_calls:
            parser = self._parsers.setdefault(choice.index, ToolCallParser(self.parallel_tool_calls))
            text, calls = parser.feed(delta.text)
            if delta.finished:
                rest, last_calls = parser.finish(cut_off=delta.finish_reason == "length")
                text, calls = text + rest, calls + last_calls
                finish_reason = _finish_reason(delta.finish_reason, parser.num_calls)
            first_index = parser.num_calls - len(calls)
            tool_calls = [
                DeltaToolCall(
                    index=first_index + offset, id=call.id, type="function",
                    function=DeltaFunctionCall(name=call.name, arguments=call.arguments),
                )
                for offset, call in enumerate(calls)
            ] or None
            if not text and tool_calls is None and not delta.finished and delta.logprobs is None:
                return None
        is_first = choice.num_chunks_sent == 0
        message = DeltaMessage(
            role="assistant" if is_first else None,
            content=text if text or (is_first and tool_calls is None) else None,
            tool_calls=tool_calls,
        )
        return ChatChunkChoice(
            index=choice.index,
            delta=message,
            logprobs=self._logprobs(delta.logprobs),
            finish_reason=finish_reason,
        )

    def whole(self, generation: Generation) -> BaseModel:
        """vLLM's prompt_logprobs sit beside the choices: they share one prompt."""
        response = super().whole(generation)
        if self.num_prompt_logprobs is not None:
            scored = generation.choices[0].output.prompt_logprobs
            response.prompt_logprobs = self.prompt_logprobs(scored, self.num_prompt_logprobs)
        return response

    def whole_choice(self, choice: Choice) -> ChatChoice:
        content, tool_calls = choice.output.text, None
        finish_reason = choice.output.finish_reason
        if self.parses_tool_calls:
            cut_off = finish_reason == "length"
            content, calls = parse_tool_calls(choice.output.text, self.parallel_tool_calls, cut_off)
            tool_calls = [
                ResponseToolCall(
                    id=call.id, function=ResponseFunctionCall(name=call.name, arguments=call.arguments)
                )
                for call in calls
            ] or None
            finish_reason = _finish_reason(finish_reason, len(calls))
        return ChatChoice(
            index=choice.index,
            message=AssistantMessage(content=content, tool_calls=tool_calls),
            logprobs=self._logprobs(choice.output.logprobs),
            finish_reason=finish_reason,
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


def _finish_reason(finish_reason: str | None, num_calls: int) -> str | None:
    """OpenAI's "tool_calls" for an output that ended on its own after calling tools."""
    return "tool_calls" if finish_reason == "stop" and num_calls else finish_reason
