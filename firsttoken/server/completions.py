"""POST /v1/completions: prompts in, text completions out (streamed or whole)."""

from __future__ import annotations

import codecs

from starlette.responses import Response

from firsttoken.engine import EngineClient, InvalidInputError, TokenizedPrompt, Tokenizer
from firsttoken.outputs import RequestDelta, SampledToken
from firsttoken.server.server_config import ServerConfig
from firsttoken.server.generation import Choice, ChoiceParams, plan_generation
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
) -> Response:
    checks.check_fields(body)
    items = _prompt_items(body)
    plan = plan_generation(engine, body, len(items), config.max_choices_per_request)
    for index, item in enumerate(items):
        if isinstance(item, str):
            checks.check_prompt_bytes("prompt" if len(items) == 1 else f"prompt[{index}]", [item])
    prompts = [await engine.tokenize(item) for item in items]
    echo_only = body.echo and body.max_tokens == 0
    # max_tokens 0 with echo: one token runs (its prefill scores the prompt) and is not shown.
    if echo_only:
        _check_room_to_echo(prompts, engine.max_model_len)
    params = ChoiceParams(
        1 if echo_only else body.max_tokens, body.logprobs,
        prompt_logprobs=body.scores_prompt, discards_output=echo_only,
    )
    try:
        generation = await plan.start(prompts, params)
    except InvalidInputError as error:
        if error.field != _ENGINE_PROMPT_FIELD:
            raise
        raise InvalidInputError("prompt", str(error)) from error  # the client knows it as `prompt`
    needs_texts = body.logprobs is not None or body.echo
    prompt_texts = _prompt_texts(engine, items) if needs_texts else [""] * len(items)
    reply = _CompletionReply(
        config.model_name, engine.tokenizer, [text for text in prompt_texts for _ in range(body.n)], body
    )
    return await respond(generation, reply, body.stream, body.include_usage, config)


def _check_room_to_echo(prompts: list[TokenizedPrompt], max_model_len: int) -> None:
    """The hidden token of an echo with max_tokens 0 needs one position after the prompt: refuse
    a prompt without it in the client's terms (the engine would speak of max_tokens 1, which the
    client never sent)."""
    for index, prompt in enumerate(prompts):
        num_tokens = len(prompt.token_ids)
        if num_tokens >= max_model_len:
            raise InvalidInputError(
                "prompt" if len(prompts) == 1 else f"prompt[{index}]",
                f"{num_tokens} prompt tokens, and the model's limit (max_model_len) is {max_model_len}: "
                "echo with max_tokens 0 scores the prompt by running one token after it, so the "
                f"prompt may hold at most {max_model_len - 1} tokens",
            )


def _prompt_items(body: CompletionRequest) -> list[str | list[int]]:
    """The prompts of a request: text, token ids, or a list of either; none may be empty."""
    prompt = body.prompt
    is_one_prompt = isinstance(prompt, str) or (bool(prompt) and isinstance(prompt[0], int))
    items = [prompt] if is_one_prompt else prompt
    if not items or not all(items):
        raise InvalidInputError("prompt", "must not be empty")
    return items


def _prompt_texts(engine: EngineClient, items: list[str | list[int]]) -> list[str]:
    """Each prompt's text, which echo repeats and whose length is where logprobs' text_offset of
    the first generated token lies (OpenAI counts offsets from the prompt's start); token ids
    count as their text."""
    return [item if isinstance(item, str) else engine.tokenizer.decode(item) for item in items]


class _CompletionReply(Reply):
    """A completion's choices: text, one object for a chunk and for the whole response."""

    id_prefix = "cmpl"
    chunk_model = CompletionResponse
    response_model = CompletionResponse

    def __init__(
        self, model: str, tokenizer: Tokenizer, prompt_texts: list[str], body: CompletionRequest
    ) -> None:
        super().__init__(model, tokenizer)
        self.prompt_texts = prompt_texts  # per choice index
        self.echo = body.echo
        self.num_logprobs = body.logprobs
        self.num_prompt_logprobs = body.prompt_logprobs

    def chunk_choice(self, choice: Choice, delta: RequestDelta) -> CompletionChoice:
        prompt_text = self.prompt_texts[choice.index]
        text, sampled = self._hiding_discarded(choice, delta.text, delta.logprobs)
        text_start = len(prompt_text) + len(choice.output.text) - len(delta.text)
        logprobs = self._logprobs(sampled, text_start)
        if self.echo and choice.num_chunks_sent == 0:
            text = prompt_text + text
            logprobs = self._echoed_logprobs(choice, logprobs)
        return CompletionChoice(
            index=choice.index,
            text=text,
            logprobs=logprobs,
            finish_reason=_finish_reason(choice, delta.finish_reason),
        )

    def whole_choice(self, choice: Choice) -> CompletionChoice:
        prompt_text = self.prompt_texts[choice.index]
        output = choice.output
        text, sampled = self._hiding_discarded(choice, output.text, output.logprobs)
        logprobs = self._logprobs(sampled, len(prompt_text))
        if self.echo:
            text = prompt_text + text
            logprobs = self._echoed_logprobs(choice, logprobs)
        return CompletionChoice(
            index=choice.index,
            text=text,
            logprobs=logprobs,
            finish_reason=_finish_reason(choice, output.finish_reason),
            prompt_logprobs=self.prompt_logprobs(output.prompt_logprobs, self.num_prompt_logprobs),
        )

    def _hiding_discarded(
        self, choice: Choice, text: str, sampled: list[SampledToken] | None
    ) -> tuple[str, list[SampledToken] | None]:
        if not choice.discards_output:
            return text, sampled
        return "", None if self.num_logprobs is None else []

    def _echoed_logprobs(
        self, choice: Choice, generated: CompletionLogprobs | None
    ) -> CompletionLogprobs | None:
        """The prompt's logprobs (its first token has none, as OpenAI's), then the generated."""
        if self.num_logprobs is None:
            return None
        scored = choice.output.prompt_logprobs or []
        first = SampledToken(choice.prompt.token_ids[0])
        prompt_part = [first] + [
            SampledToken(token.token_id, token.logprob, (token.top_logprobs or [])[: self.num_logprobs])
            for token in scored[1:]
            if token is not None
        ]
        echoed = self._logprobs(prompt_part, 0)
        assert echoed is not None
        if generated is None:
            return echoed
        return CompletionLogprobs(
            tokens=echoed.tokens + generated.tokens,
            token_logprobs=echoed.token_logprobs + generated.token_logprobs,
            top_logprobs=echoed.top_logprobs + generated.top_logprobs,
            text_offset=echoed.text_offset + generated.text_offset,
        )

    def _logprobs(self, sampled: list[SampledToken] | None, text_start: int) -> CompletionLogprobs | None:
        """OpenAI's legacy shape; text_offset: where each token starts, in characters, the first
        at `text_start`. A token without alternatives (an echoed prompt's first) has null ones."""
        if sampled is None:
            return None
        pieces = [self.tokenizer.token_bytes(token.token_id) for token in sampled]
        return CompletionLogprobs(
            tokens=[self.token_text(token.token_id) for token in sampled],
            token_logprobs=[token.logprob for token in sampled],
            top_logprobs=[
                None if token.top_logprobs is None
                else {self.token_text(top.token_id): top.logprob for top in token.top_logprobs}
                for token in sampled
            ],
            text_offset=text_offsets(pieces, text_start),
        )


def _finish_reason(choice: Choice, finish_reason: str | None) -> str | None:
    """A prompt scored alone (max_tokens 0) ends by length, whatever its one hidden token was."""
    return "length" if choice.discards_output and finish_reason is not None else finish_reason


def text_offsets(pieces: list[bytes], text_start: int) -> list[int]:
    """Where each token's text starts, in characters from `text_start`. A character split across
    tokens starts with its first token, so a token that only completes it shares that offset."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    offsets = []
    for piece in pieces:
        offsets.append(text_start)
        text_start += len(decoder.decode(piece))
    return offsets
