"""From an OpenAI request to engine requests and back, for both endpoints.

An endpoint plans its generation (the number of choices checked before any expensive work),
then starts it with its prompts and per-choice parameters: every choice submitted at once (all or
none). The started Generation merges its choices' deltas and says what they add up to: usage,
the TTFT extension, Server-Timing.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from dataclasses import dataclass
from typing import AsyncIterator

from firsttoken.engine import DeltaStream, EngineClient, InvalidInputError, TokenizedPrompt
from firsttoken.metrics.ttft_stages import TTFTStages
from firsttoken.outputs import RequestDelta, RequestOutput
from firsttoken.sampling_params import SamplingParams, StructuredOutput, choice_seed
from firsttoken.server.protocol import (
    ChoiceTTFT,
    FirstTokenExtension,
    GenerationRequest,
    PromptTokensDetails,
    Usage,
)

# Temperatures this small are greedy: dividing logits by them overflows (vLLM does the same).
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class ChoiceParams:
    """What an endpoint decides for every choice; the rest of the sampling parameters come from
    the request. A missing max_tokens means the rest of the context (as vLLM)."""

    max_tokens: int | None
    logprobs: int | None
    # A constraint of the endpoint's own (a forced tool call), else the request's
    # (response_format, guided_*).
    structured_output: StructuredOutput | None = None
    prompt_logprobs: int | None = None
    # The generated tokens are not shown or billed (a completion of max_tokens 0 with echo,
    # which runs one token to score the prompt).
    discards_output: bool = False


@dataclass
class Choice:
    """One choice of a response: its engine request's stream and what it produced so far."""

    index: int
    prompt: TokenizedPrompt
    stream: DeltaStream
    output: RequestOutput
    num_chunks_sent: int = 0
    discards_output: bool = False  # as ChoiceParams.discards_output

    def ttft_stages(self) -> TTFTStages | None:
        if self.output.metrics is None:
            return None
        return TTFTStages.from_metrics(self.output.metrics, self.stream.first_token_time)


@dataclass(frozen=True)
class GenerationPlan:
    """A request whose number of choices was found admissible; `start` submits them."""

    engine: EngineClient
    request: GenerationRequest
    num_prompts: int

    async def start(self, prompts: list[TokenizedPrompt], params: ChoiceParams) -> Generation:
        """Submit `request.n` choices per prompt in one go (so they share engine steps); if one
        is refused, none stays. A given max_tokens that does not fit is the engine's to refuse
        (InvalidInputError)."""
        assert len(prompts) == self.num_prompts  # the number the plan's check was made for
        max_request_tokens = self.engine.max_request_tokens
        requests = [
            (prompt, _sampling_params(self.request, prompt, params, max_request_tokens, index))
            for prompt in prompts
            for index in range(self.request.n)
        ]
        streams = await _submit_all(self.engine, requests, self.request.priority, self.request.ttft_slo_ms)
        return Generation([
            Choice(
                index, prompt, stream, RequestOutput(stream.req_id, None, prompt.token_ids),
                discards_output=params.discards_output,
            )
            for index, ((prompt, _), stream) in enumerate(zip(requests, streams, strict=True))
        ])


def plan_generation(
    engine: EngineClient, request: GenerationRequest, num_prompts: int, max_choices: int
) -> GenerationPlan:
    """Every choice is an engine request, all submitted at once: refuse a request that asks for
    more than `max_choices`, or for more than the waiting queue could ever take (it would be
    refused as "queue full" however long the client retried). Cheap, so it runs before the
    prompts are tokenized."""
    num_choices = num_prompts * request.n
    if num_choices > max_choices:
        raise InvalidInputError(
            "n",
            f"{num_prompts} prompt(s) x n={request.n} is {num_choices} choices, more than the "
            f"{max_choices} allowed",
        )
    max_waiting = engine.max_waiting_requests
    if max_waiting is not None and num_choices > max_waiting:
        raise InvalidInputError(
            "n",
            f"{num_prompts} prompt(s) x n={request.n} is {num_choices} choices, submitted together, "
            f"and the waiting queue holds {max_waiting}: this request could never be admitted",
        )
    return GenerationPlan(engine, request, num_prompts)


@dataclass
class Generation:
    """The started choices of one response, in index order."""

    choices: list[Choice]

    @property
    def finished(self) -> bool:
        return all(choice.output.finished for choice in self.choices)

    async def deltas(self) -> AsyncIterator[tuple[Choice, RequestDelta]]:
        """Every choice's deltas as they arrive, each already added to its choice's output."""
        if len(self.choices) == 1:
            (choice,) = self.choices
            async for delta in choice.stream:
                choice.output.add(delta)
                yield choice, delta
            return
        arrivals: asyncio.Queue[tuple[Choice, RequestDelta | Exception]] = asyncio.Queue()

        async def pump(choice: Choice) -> None:
            try:
                async for delta in choice.stream:
                    arrivals.put_nowait((choice, delta))
            except Exception as error:  # EngineDeadError: re-raised by the consumer below
                arrivals.put_nowait((choice, error))

        tasks = [asyncio.create_task(pump(choice)) for choice in self.choices]
        try:
            num_unfinished = len(self.choices)
            while num_unfinished:
                choice, item = await arrivals.get()
                if isinstance(item, Exception):
                    raise item
                choice.output.add(item)
                if item.finished:
                    num_unfinished -= 1
                yield choice, item
        finally:
            for task in tasks:
                task.cancel()

    async def run_to_completion(self) -> None:
        async with contextlib.aclosing(self.deltas()) as deltas:
            async for _ in deltas:
                pass

    async def close(self) -> None:
        """Abort whatever has not finished (client gone, error, cancellation)."""
        await _close_streams([choice.stream for choice in self.choices])

    def usage(self) -> Usage:
        """Prompt tokens count once per prompt (not per choice), as OpenAI bills them."""
        first_choice_of_prompt: dict[int, Choice] = {}
        for choice in self.choices:
            first_choice_of_prompt.setdefault(id(choice.prompt), choice)
        first_choices = first_choice_of_prompt.values()
        prompt_tokens = sum(len(choice.prompt.token_ids) for choice in first_choices)
        cached_tokens = sum(choice.output.num_cached_tokens for choice in first_choices)
        completion_tokens = sum(len(c.output.token_ids) for c in self.choices if not c.discards_output)
        return Usage(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
        )

    def ttft_extension(self) -> FirstTokenExtension:
        entries = []
        for choice in self.choices:
            stages = choice.ttft_stages()
            if stages is not None:
                entries.append(ChoiceTTFT(index=choice.index, **dataclasses.asdict(stages)))
        return FirstTokenExtension(choices=entries)

    def server_timing(self) -> str:
        """The TTFT stages as a Server-Timing header (milliseconds): one choice's as they are,
        several choices' as the slowest of each stage, so the header stays a few hundred bytes
        however many."""
        durations_per_choice = [
            stages.durations() for choice in self.choices if (stages := choice.ttft_stages())
        ]
        if not durations_per_choice:
            return ""
        num_choices = len(self.choices)
        description = f';desc="slowest of {num_choices} choices"' if num_choices > 1 else ""
        entries = []
        for name in durations_per_choice[0]:
            measured = [durations[name] for durations in durations_per_choice if durations[name] is not None]
            if measured:
                entries.append(f"{name};dur={max(measured) * 1000:.3f}{description}")
        return ", ".join(entries)


def _sampling_params(
    request: GenerationRequest,
    prompt: TokenizedPrompt,
    params: ChoiceParams,
    max_request_tokens: int,
    choice_index: int,
) -> SamplingParams:
    num_prompt_tokens = len(prompt.token_ids)
    max_tokens = params.max_tokens
    if max_tokens is None:
        max_tokens = max_request_tokens - num_prompt_tokens
        if max_tokens < 1:
            raise InvalidInputError(
                "prompt",
                f"{num_prompt_tokens} tokens leave no room for output within the "
                f"{max_request_tokens} tokens a request may hold",
            )
    temperature = 1.0 if request.temperature is None else request.temperature
    stop = request.stop if request.stop is not None else ()
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0 if temperature < GREEDY_BELOW else temperature,
        top_p=1.0 if request.top_p is None else request.top_p,
        top_k=-1 if request.top_k is None else request.top_k,
        # Choices of one request draw differently from each other, reproducibly.
        seed=None if request.seed is None else choice_seed(request.seed, choice_index),
        stop=stop,
        ignore_eos=request.ignore_eos,
        logprobs=params.logprobs,
        prompt_logprobs=params.prompt_logprobs,
        presence_penalty=request.presence_penalty or 0.0,
        frequency_penalty=request.frequency_penalty or 0.0,
        repetition_penalty=1.0 if request.repetition_penalty is None else request.repetition_penalty,
        min_p=request.min_p or 0.0,
        logit_bias={int(token_id): bias for token_id, bias in (request.logit_bias or {}).items()},
        min_tokens=request.min_tokens,
        stop_token_ids=tuple(request.stop_token_ids or ()),
        bad_words=tuple(request.bad_words or ()),
        include_stop_str_in_output=request.include_stop_str_in_output,
        skip_special_tokens=request.skip_special_tokens,
        structured_output=params.structured_output or request.structured_output(),
    )


async def _submit_all(
    engine: EngineClient,
    requests: list[tuple[TokenizedPrompt, SamplingParams]],
    priority: int,
    ttft_slo_ms: float | None,
) -> list[DeltaStream]:
    """Each request's stream; if one is refused, the others are closed and its error raised.
    Cancelled (the client left), it closes those already admitted: each one still waiting for
    admission aborts its own request."""
    submissions = [
        asyncio.ensure_future(engine.add_request(prompt, params, priority=priority, ttft_slo_ms=ttft_slo_ms))
        for prompt, params in requests
    ]
    try:
        results = await asyncio.gather(*submissions, return_exceptions=True)
    except asyncio.CancelledError:
        await _close_streams([submission.result() for submission in submissions if _admitted(submission)])
        raise
    streams = [result for result in results if not isinstance(result, BaseException)]
    error = next((result for result in results if isinstance(result, BaseException)), None)
    if error is not None:
        await _close_streams(streams)
        raise error
    return streams


def _admitted(submission: asyncio.Future[DeltaStream]) -> bool:
    return submission.done() and not submission.cancelled() and submission.exception() is None


async def _close_streams(streams: list[DeltaStream]) -> None:
    for stream in streams:
        await stream.aclose()
