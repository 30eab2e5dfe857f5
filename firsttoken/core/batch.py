"""The boundary between scheduler and model runner: plain data, no tensors, no Request."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from firsttoken.outputs import SampledToken
from firsttoken.sampling_params import SamplingParams


@dataclass(frozen=True)
class SampleSpec:
    """How to pick the token after a scheduled chunk, which output token it will be, and whose."""

    sampling_params: SamplingParams
    output_index: int  # 0 for the first generated token; makes seeded sampling reproducible
    req_id: str  # finds the sampler's token counts of a request that tracks its tokens


@dataclass(frozen=True)
class TrackedRequest:
    """A request whose logits depend on its tokens so far (penalties, bad words, min_tokens,
    structured output):
    what the sampler needs of it beyond its parameters, sent once, with the step that first
    schedules it. The sampler counts its generated tokens from there on, as they come back as
    step inputs, until the engine releases it."""

    req_id: str
    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    stop_token_ids: tuple[int, ...]  # the ids that would end it: min_tokens keeps them from being drawn
    bad_words_token_ids: tuple[tuple[int, ...], ...]
    # Its compiled grammar (the worker's CompiledGrammar; opaque here); None without one.
    grammar: Any = None


@dataclass(frozen=True)
class PromptLogprobSpec:
    """The rows of a prompt chunk that score the prompt: the row at position p scores prompt
    token p + 1 (its logits predict it)."""

    first_position: int  # the position of the first scoring row
    target_token_ids: list[int]  # the prompt token each scoring row scores, in position order
    num_top: int  # the likeliest alternatives to report with each

    @property
    def num_rows(self) -> int:
        return len(self.target_token_ids)


@dataclass(frozen=True)
class ScheduledChunk:
    """One request's work in a step: compute KV for `token_ids` at positions from `start_position`."""

    req_id: str
    token_ids: list[int]
    start_position: int
    block_table: list[int]
    sample: SampleSpec | None  # None while a prompt's chunk does not reach its last token
    # A prompt's (or a recompute's) chunk: run as a prefill even when it is one token, so a
    # token's KV comes from the prefill attention kernel whatever the chunk boundaries. A
    # one-token chunk without it is a decode.
    prefill: bool = False
    # A decode that verifies proposed tokens: the last `num_draft_tokens` of `token_ids` are
    # proposals, and every one of them samples too (the model's choice after each).
    num_draft_tokens: int = 0
    # Rows that score prompt tokens (a request with prompt_logprobs); None for most chunks.
    prompt_logprobs: PromptLogprobSpec | None = None

    @property
    def is_decode(self) -> bool:
        return len(self.token_ids) == 1 and not self.prefill

    @property
    def num_sampled_rows(self) -> int:
        return 0 if self.sample is None else 1 + self.num_draft_tokens

    def sample_specs(self) -> list[SampleSpec]:
        """One spec per sampled row: a verify chunk's rows draw output tokens i, i + 1, ..."""
        if self.sample is None:
            return []
        first = self.sample
        return [
            SampleSpec(first.sampling_params, first.output_index + i, first.req_id)
            for i in range(self.num_sampled_rows)
        ]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class SchedulerOutput:
    """Everything the runner needs for one step."""

    chunks: list[ScheduledChunk]
    # Requests the sampler starts tracking before this step's chunks run.
    new_tracked_requests: list[TrackedRequest] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(chunk.num_tokens for chunk in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks

    @property
    def scores_prompts(self) -> bool:
        """Whether some chunk scores prompt tokens: an LM head and a log-softmax per scored row."""
        return any(chunk.prompt_logprobs is not None for chunk in self.chunks)


@dataclass(frozen=True)
class ModelOutput:
    """What one step produced: a token for each chunk that samples."""

    sampled: dict[str, SampledToken]
    # A verify chunk's further tokens: the model's choice after each of its proposals, in order.
    verified: dict[str, list[SampledToken]] = field(default_factory=dict)
    # The scored prompt tokens of each chunk with a PromptLogprobSpec, in position order.
    prompt_logprobs: dict[str, list[SampledToken]] = field(default_factory=dict)
