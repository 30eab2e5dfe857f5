"""OpenAI request and response bodies (pydantic), with firsttoken's extensions.

Requests are validated strictly (no "1" for 1, no 1 for true), as the OpenAI API does; the
limits sit in the schema, so /openapi.json documents them and a bad value is a clean 400.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from firsttoken.engine import CHAT_ROLES, InvalidInputError
from firsttoken.limits import MAX_MILLISECONDS
from firsttoken.sampling_params import StructuredOutput
from firsttoken.server.schema_checks import checked_schema_text

MAX_N = 16  # choices per prompt; each one is an independent engine request
MAX_LOGPROBS = 20
# Every stop string is searched for in every request's new text at every step.
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
# Every step builds a row's biases, stop ids and bad-word checks in Python: bounded per request.
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_STOP_TOKEN_IDS = 64
MAX_BAD_WORDS = 64
MAX_TOOLS = 128


def _one_error_for_union(expected: str) -> WrapValidator:
    """Replace a union's per-member errors with one message saying what was expected."""

    def validate(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError("union_type", f"must be {expected}") from None

    return WrapValidator(validate)


CompletionPrompt = Annotated[
    Union[str, list[str], list[int], list[list[int]]],
    _one_error_for_union("a string, a list of strings, a list of token ids or a list of token-id lists"),
]
Stop = Annotated[Union[str, list[str], None], _one_error_for_union("a string or a list of strings")]
TokenIdKey = Annotated[str, StringConstraints(pattern=r"^[0-9]{1,10}$")]
LogitBias = dict[TokenIdKey, Annotated[float, Field(ge=-100, le=100)]]
BadWord = Annotated[str, StringConstraints(min_length=1, max_length=MAX_STOP_STRING_CHARS, pattern=r"\S")]


class _StrictModel(BaseModel):
    """A request part validated strictly: no type coercion."""

    model_config = ConfigDict(strict=True)


class RequestBody(_StrictModel):
    """A request's body: validated strictly, keeping the fields the API does not define so that
    they can be named (and refused with --strict-fields)."""

    model_config = ConfigDict(strict=True, extra="allow")

    def unknown_fields(self) -> list[str]:
        return list(self.model_extra or {})


class StreamOptions(_StrictModel):
    """Options of a streamed reply."""

    include_usage: bool = False


class TextContentPart(_StrictModel):
    """One text part of a message's content."""

    type: Literal["text"]
    text: str


MessageContent = Annotated[
    Union[str, list[TextContentPart]], _one_error_for_union("a string or a list of text parts")
]


class FunctionCall(_StrictModel):
    """The function an assistant's tool call names, and its arguments as JSON text."""

    name: str
    arguments: str


class ToolCall(_StrictModel):
    """One tool call of an assistant's message."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_StrictModel):
    """One message of a conversation: an assistant's may call tools (then its content may be
    null), a tool's answers the call `tool_call_id`."""

    role: Literal[CHAT_ROLES]  # type: ignore[valid-type]
    content: MessageContent | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def template_message(self) -> dict[str, Any]:
        """The message as chat templates read it (transformers' shape: a call's arguments as an
        object, as vLLM passes them)."""
        message: dict[str, Any] = {
            "role": self.role,
            "content": self.text() if self.content is not None else None,
        }
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {
                        "name": call.function.name,
                        "arguments": _arguments_object(call.function.arguments),
                    },
                }
                for call in self.tool_calls
            ]
        return message


def _check_messages(messages: list[ChatMessage]) -> None:
    """Content is required except in an assistant's message that calls tools; only an
    assistant's message calls tools."""
    for index, message in enumerate(messages):
        if message.content is None and not (message.role == "assistant" and message.tool_calls):
            raise InvalidInputError(
                f"messages[{index}].content",
                "Field required (except in an assistant's message with tool_calls)",
            )
        if message.tool_calls and message.role != "assistant":
            raise InvalidInputError(
                f"messages[{index}].tool_calls", "only an assistant's message may call tools"
            )


def _arguments_object(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        raise InvalidInputError("tool_calls.function.arguments", "must be JSON text") from None


class FunctionDefinition(_StrictModel):
    """A function the model may call: its name, what it does, its parameters' JSON schema."""

    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = Field(None, description="accepted; forced calls always follow the schema")


class Tool(_StrictModel):
    """A tool of the request (only functions)."""

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_StrictModel):
    name: str


class NamedToolChoice(_StrictModel):
    """tool_choice forcing one function."""

    type: Literal["function"]
    function: NamedFunction


ToolChoice = Annotated[
    Union[Literal["none", "auto", "required"], NamedToolChoice],
    _one_error_for_union('"none", "auto", "required" or {"type": "function", "function": {"name": ...}}'),
]


# Accepted only at the value that changes nothing: honouring them is not implemented, and
# silently ignoring a real value would return something the client did not ask for.
_UNSUPPORTED_UNLESS_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
    "tools": (None, []),  # on completions; chat completions define them
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
}


class JsonSchemaFormat(_StrictModel):
    """response_format's json_schema: the schema the output must validate against."""

    model_config = ConfigDict(strict=True, populate_by_name=True)

    name: str = Field("response", max_length=64)
    description: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = Field(None, description="accepted; the schema is always enforced")


class ResponseFormat(_StrictModel):
    """OpenAI's response_format: free text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


GuidedJson = Annotated[
    Union[str, dict[str, Any]], _one_error_for_union("a JSON schema (an object or its text)")
]


class GenerationRequest(RequestBody):
    """Fields both generation endpoints share."""

    model: str | None = Field(None, description="a served model name; default: the first one")
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, description="firsttoken extension: -1 disables")
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    stop: Stop = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = Field(False, description="firsttoken extension: keep generating past end-of-sequence")
    n: int = Field(1, ge=1, le=MAX_N)
    presence_penalty: float | None = Field(
        None, ge=-2, le=2, description="subtracted once from every token generated so far"
    )
    frequency_penalty: float | None = Field(
        None, ge=-2, le=2, description="subtracted from a token's logit once per time it was generated"
    )
    logit_bias: LogitBias | None = Field(
        None,
        max_length=MAX_LOGIT_BIAS_ENTRIES,
        description="token id (as a string) -> bias in [-100, 100], added to its logit",
    )
    repetition_penalty: float | None = Field(
        None,
        gt=0,
        description="vLLM extension: a token of the prompt or the output has its logit divided by this "
        "when positive, multiplied when negative (1: off)",
    )
    min_p: float | None = Field(
        None, ge=0, le=1, description="vLLM extension: drop tokens less likely than min_p x the likeliest"
    )
    min_tokens: int = Field(
        0, ge=0, description="vLLM extension: end-of-sequence and stop_token_ids wait for this many tokens"
    )
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(
        None, max_length=MAX_STOP_TOKEN_IDS, description="vLLM extension: token ids that end the output"
    )
    bad_words: list[BadWord] | None = Field(
        None, max_length=MAX_BAD_WORDS, description="vLLM extension: words never generated"
    )
    include_stop_str_in_output: bool = Field(False, description="vLLM extension: keep the stop string")
    skip_special_tokens: bool = Field(True, description="vLLM extension: leave special tokens out of text")
    user: str | None = Field(None, description="accepted and ignored")
    priority: int = Field(0, ge=-(2**31), le=2**31 - 1, description="firsttoken extension: lower runs first")
    ttft_slo_ms: float | None = Field(
        None,
        gt=0,
        le=MAX_MILLISECONDS,
        description="firsttoken extension: this request's TTFT objective in ms (default: the server's)",
    )
    response_format: ResponseFormat | None = Field(
        None, description="json_object: any JSON object; json_schema: JSON valid against its schema"
    )
    guided_json: GuidedJson | None = Field(
        None, description="vLLM extension: the output is JSON valid against it"
    )
    guided_regex: str | None = Field(
        None, description="vLLM extension: the output matches this regular expression"
    )
    guided_choice: list[str] | None = Field(
        None, description="vLLM extension: the output is one of these strings"
    )
    guided_grammar: str | None = Field(
        None, description="vLLM extension: the output follows this grammar (GBNF/EBNF as llama.cpp, or Lark)"
    )

    @model_validator(mode="after")
    def _check_neutral_fields(self) -> GenerationRequest:
        for name, value in (self.model_extra or {}).items():
            neutral = _UNSUPPORTED_UNLESS_NEUTRAL.get(name)
            if neutral is not None and value not in neutral:
                raise InvalidInputError(name, "is not supported yet; leave it unset")
        if self.stream_options is not None and not self.stream:
            raise InvalidInputError("stream_options", "only allowed when stream is true")
        _check_stop_strings(self.stop)
        self.structured_output()  # a constraint given twice is refused at validation
        return self

    def structured_output(self) -> StructuredOutput | None:
        """The output constraint of response_format or a guided_* field (at most one)."""
        given = []
        if self.response_format is not None and self.response_format.type != "text":
            given.append(_response_format_constraint(self.response_format))
        if self.guided_json is not None:
            given.append(StructuredOutput(json_schema=checked_schema_text(self.guided_json, "guided_json"),
                                          field="guided_json"))
        if self.guided_regex is not None:
            given.append(StructuredOutput(regex=self.guided_regex, field="guided_regex"))
        if self.guided_choice is not None:
            given.append(StructuredOutput(choice=tuple(self.guided_choice), field="guided_choice"))
        if self.guided_grammar is not None:
            given.append(StructuredOutput(grammar=self.guided_grammar, field="guided_grammar"))
        if len(given) > 1:
            raise InvalidInputError(
                given[1].field, f"give one output constraint; {given[0].field} is given too"
            )
        return given[0] if given else None

    def unknown_fields(self) -> list[str]:
        """Fields the request holds that the API does not define (accepted, and ignored)."""
        return [name for name in super().unknown_fields() if name not in _UNSUPPORTED_UNLESS_NEUTRAL]

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


def _response_format_constraint(response_format: ResponseFormat) -> StructuredOutput:
    if response_format.type == "json_object":
        return StructuredOutput(json_object=True, field="response_format")
    if response_format.json_schema is None:
        raise InvalidInputError("response_format.json_schema", "required when type is json_schema")
    field = "response_format.json_schema.schema"
    schema = checked_schema_text(response_format.json_schema.json_schema, field)
    return StructuredOutput(json_schema=schema, field=field)


def _check_stop_strings(stop: str | list[str] | None) -> None:
    stop_strings = [stop] if isinstance(stop, str) else stop or []
    if len(stop_strings) > MAX_STOP_STRINGS:
        raise InvalidInputError(
            "stop", f"{len(stop_strings)} strings, more than the {MAX_STOP_STRINGS} allowed"
        )
    for index, text in enumerate(stop_strings):
        if len(text) > MAX_STOP_STRING_CHARS:
            raise InvalidInputError(
                "stop" if isinstance(stop, str) else f"stop[{index}]",
                f"{len(text)} characters, more than the {MAX_STOP_STRING_CHARS} allowed",
            )


class CompletionRequest(GenerationRequest):
    """POST /v1/completions."""

    prompt: CompletionPrompt
    max_tokens: int | None = Field(
        None, ge=0, description="default: the rest of the context; 0 only with echo (the prompt scored)"
    )
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = Field(False, description="the prompt before the completion; with logprobs, the prompt's too")
    prompt_logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS,
        description="vLLM extension: each prompt token's logprob and top alternatives",
    )

    @model_validator(mode="after")
    def _check_echo(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise InvalidInputError("max_tokens", "must be >= 1 (0 only with echo: the prompt alone, scored)")
        _check_prompt_logprobs_not_streamed(self.prompt_logprobs, self.stream)
        return self

    @property
    def scores_prompt(self) -> int | None:
        """The prompt alternatives the engine must score (echo with logprobs, prompt_logprobs)."""
        wanted = [self.prompt_logprobs, self.logprobs if self.echo else None]
        return max((value for value in wanted if value is not None), default=None)


def _check_prompt_logprobs_not_streamed(prompt_logprobs: int | None, stream: bool) -> None:
    # As vLLM: prompt logprobs belong to the whole response.
    if prompt_logprobs is not None and stream:
        raise InvalidInputError("prompt_logprobs", "is not available when stream is true")


class ChatCompletionRequest(GenerationRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="default: the rest of the context")
    max_tokens: int | None = Field(None, ge=1, description="deprecated alias of max_completion_tokens")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    prompt_logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS,
        description="vLLM extension: each prompt token's logprob and top alternatives",
    )

    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    parallel_tool_calls: bool = Field(True, description="false: at most one tool call")
    tool_choice: ToolChoice | None = Field(None, description='default: "auto" with tools, else "none"')
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="vLLM extension: more variables for the chat template"
    )
    documents: list[dict[str, Any]] | None = Field(None, description="vLLM extension: for the chat template")

    @model_validator(mode="after")
    def _check_messages_and_logprobs(self) -> ChatCompletionRequest:
        _check_messages(self.messages)
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidInputError("top_logprobs", "requires logprobs to be true")
        _check_prompt_logprobs_not_streamed(self.prompt_logprobs, self.stream)
        return self

    @model_validator(mode="after")
    def _check_tools(self) -> ChatCompletionRequest:
        """Whatever the tool choice, a tool's name is unique and its parameters a usable schema."""
        names: set[str] = set()
        for index, tool in enumerate(self.tools or ()):
            function = tool.function
            if function.name in names:
                raise InvalidInputError(
                    f"tools[{index}].function.name", f"{function.name!r} names an earlier tool too"
                )
            names.add(function.name)
            if function.parameters is not None:
                checked_schema_text(function.parameters, f"tools[{index}].function.parameters")
        return self

    @model_validator(mode="after")
    def _check_tool_choice(self) -> ChatCompletionRequest:
        choice = self.tool_choice
        if choice is None or choice == "none":
            return self
        if not self.tools:
            raise InvalidInputError("tool_choice", f"{self.tool_choice_name!r} needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in {
            tool.function.name for tool in self.tools
        }:
            raise InvalidInputError("tool_choice", f"no tool is named {choice.function.name!r}")
        if self.forces_tool_call and self.structured_output() is not None:
            raise InvalidInputError(
                "tool_choice", f"{self.tool_choice_name!r} and an output constraint exclude each other"
            )
        return self

    @property
    def tool_choice_name(self) -> str:
        """The tool choice in a word: none, auto, required, or function (a named one)."""
        choice = self.tool_choice or ("auto" if self.tools else "none")
        return choice if isinstance(choice, str) else "function"

    @property
    def forced_function(self) -> str | None:
        return self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None

    @property
    def forces_tool_call(self) -> bool:
        return self.tool_choice_name in ("required", "function")

    def unknown_fields(self) -> list[str]:
        return [name for name in super().unknown_fields() if name not in ("tools", "tool_choice")]


class TokenizeRequest(RequestBody):
    """POST /tokenize (vLLM's shape): a prompt, or messages rendered with the chat template."""

    model: str | None = Field(None, description="a served model name; default: the first one")
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_generation_prompt: bool = Field(True, description="with messages: end with the assistant's turn")
    add_special_tokens: bool = Field(
        True, description="add the tokenizer's special tokens (BOS), as generation does"
    )
    return_token_strs: bool = Field(False, description="also return each token's string")

    @model_validator(mode="after")
    def _check_one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise InvalidInputError("prompt", "give either prompt or messages")
        _check_messages(self.messages or [])
        return self


class DetokenizeRequest(RequestBody):
    """POST /detokenize (vLLM's shape): token ids back to text."""

    model: str | None = Field(None, description="a served model name; default: the first one")
    tokens: list[int]


# -- responses --------------------------------------------------------------------------------


def _omit_if_none() -> Any:
    return Field(None, exclude_if=lambda value: value is None)


class PromptTokensDetails(BaseModel):
    """How many prompt tokens came from the prefix cache."""

    cached_tokens: int


class Usage(BaseModel):
    """Token counts of a whole response (prompt tokens once per prompt)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class ChoiceTTFT(BaseModel):
    """One choice's time to first token, split into stages (seconds; null if not reached)."""

    index: int
    num_cached_tokens: int
    tokenize_s: float
    queue_s: float | None
    prefill_s: float | None = Field(description="first scheduled to first token sampled")
    first_token_handoff_s: float | None = Field(
        description="first token sampled to first token handed to HTTP"
    )
    ttft_s: float | None = Field(description="arrival to first token handed to HTTP; the stages' sum")


class FirstTokenExtension(BaseModel):
    """firsttoken's extension of the final response or chunk: TTFT stages of each choice."""

    choices: list[ChoiceTTFT]


class CompletionLogprobs(BaseModel):
    """Log-probabilities of a completion's tokens, in OpenAI's legacy shape."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(BaseModel):
    """vLLM's entry of a prompt token or an alternative to it."""

    logprob: float
    rank: int | None
    decoded_token: str


# vLLM's prompt_logprobs: per prompt token (the first None), token id -> its entry.
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    """One completion, or its part in a streamed chunk."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    prompt_logprobs: PromptLogprobs | None = _omit_if_none()


class CompletionResponse(BaseModel):
    """A completion, or one chunk of a streamed completion (same object)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    firsttoken: FirstTokenExtension | None = _omit_if_none()


class TopLogprob(BaseModel):
    """A candidate token and its log-probability."""

    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    """A generated token, its log-probability and the likeliest alternatives."""

    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    """Log-probabilities of a chat choice's tokens."""

    content: list[TokenLogprob] | None


class ResponseFunctionCall(BaseModel):
    """A called function: its name and arguments (JSON text)."""

    name: str
    arguments: str


class ResponseToolCall(BaseModel):
    """A tool call the model made."""

    id: str
    type: Literal["function"] = "function"
    function: ResponseFunctionCall


class AssistantMessage(BaseModel):
    """The reply of a whole chat completion."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: str | None = None
    # Left out of a reply without calls, as OpenAI does (not an empty list).
    tool_calls: list[ResponseToolCall] | None = _omit_if_none()


class DeltaFunctionCall(BaseModel):
    """A streamed part of a tool call's function."""

    name: str | None = _omit_if_none()
    arguments: str | None = _omit_if_none()


class DeltaToolCall(BaseModel):
    """A streamed part of a tool call: its index among the message's calls, and its id, type and
    name with its first part."""

    index: int
    id: str | None = _omit_if_none()
    type: Literal["function"] | None = _omit_if_none()
    function: DeltaFunctionCall


class ChatChoice(BaseModel):
    """One choice of a whole chat completion."""

    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    """A whole chat completion."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = _omit_if_none()
    firsttoken: FirstTokenExtension | None = _omit_if_none()


class DeltaMessage(BaseModel):
    """What a chat chunk adds to its choice's message; the role only with the first content."""

    role: Literal["assistant"] | None = _omit_if_none()
    content: str | None = _omit_if_none()
    tool_calls: list[DeltaToolCall] | None = _omit_if_none()


class ChatChunkChoice(BaseModel):
    """One choice's part of a streamed chat chunk."""

    index: int
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    """One server-sent event of a streamed chat completion."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    firsttoken: FirstTokenExtension | None = _omit_if_none()


class TokenizeResponse(BaseModel):
    """The tokens of a /tokenize request, and the context they must fit."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = _omit_if_none()


class DetokenizeResponse(BaseModel):
    """The text of a /detokenize request's tokens."""

    prompt: str


class ModelCard(BaseModel):
    """A served model name."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "firsttoken"
    max_model_len: int
    # How the engine computes, chosen at start (measured where the options said auto), and why.
    dtype: str
    batch_invariant: bool
    start_up_choices: list[str]


class ModelList(BaseModel):
    """GET /v1/models."""

    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    """What went wrong: a message naming the field, OpenAI's type and code."""

    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every error reply."""

    error: ErrorBody
