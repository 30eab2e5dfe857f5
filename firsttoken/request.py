"""Request: the one mutable record of a request's tokens, progress, status and timestamps."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from firsttoken.logprobs import SampledToken
from firsttoken.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"

    @property
    def finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISHED = {
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
    RequestStatus.FINISHED_ERROR,
}
_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass
class RequestTimestamps:
    """perf_counter() stamps of the events that make up a request's TTFT and latency."""

    arrival: float
    tokenized: float | None = None
    first_scheduled: float | None = None
    prefill_chunk_ends: list[float] = field(default_factory=list)
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None


@dataclass
class Request:
    """A request's tokens (prompt then output), how many have KV in the cache, and its state.

    `num_computed_tokens` catches up with `num_tokens`: prefill and decode are just how many
    tokens a step takes. `block_hashes` holds the chained hash of every full block of tokens.
    """

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    max_total_tokens: int
    timestamps: RequestTimestamps
    priority: int = 0
    # Its TTFT objective in seconds (the request's own, else the engine's); None: best effort.
    ttft_slo_s: float | None = None
    # The TTFT the scheduler predicted on arrival (seconds from arrival), with an objective.
    predicted_ttft_s: float | None = None
    # The step whose decodes it sat out so that an at-risk prefill could meet its objective;
    # it is never left out of two steps running.
    decode_deferred_step: int | None = None
    status: RequestStatus = RequestStatus.WAITING
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    block_hashes: list[bytes] = field(default_factory=list)
    # The step since which it has waited for prefill progress: set on arrival and whenever a
    # chunk of it is scheduled, so aging measures starvation, not age.
    waiting_since_step: int = 0
    stop_reason: int | str | None = None
    # The token ids of sampling_params.bad_words, each word as it starts text and as it follows
    # a space (tokenized by the engine, which holds the tokenizer).
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    # Its compiled grammar when sampling_params.structured_output is set (the worker's
    # CompiledGrammar, compiled by the engine on arrival; opaque here).
    grammar: Any = None
    # Prompt tokens 1, 2, ... scored so far, when sampling_params.prompt_logprobs asks for them.
    prompt_logprobs: list[SampledToken] = field(default_factory=list)
    # Proposed tokens to follow token_ids, set by the engine after a step's update for the next
    # step to verify; the scheduler takes (and clears) them when it schedules that step.
    draft_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def needs_prompt_logprobs(self) -> bool:
        """It asks for prompt logprobs and some prompt token is not scored yet."""
        wanted = self.sampling_params.prompt_logprobs is not None
        return wanted and len(self.prompt_logprobs) < self.num_prompt_tokens - 1

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def discard_output_tokens(self, count: int) -> None:
        """Drop the last `count` output tokens (appended in the step that then hit a stop string)."""
        if not 0 <= count <= self.num_output_tokens:
            raise ValueError(f"cannot discard {count} of {self.num_output_tokens} output tokens")
        del self.token_ids[len(self.token_ids) - count :]

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """The ids that end it when drawn: end-of-sequence (unless ignored) and stop_token_ids."""
        params = self.sampling_params
        eos_token_ids = () if params.ignore_eos else self.eos_token_ids
        return tuple(sorted(set(eos_token_ids) | set(params.stop_token_ids)))

    def append_output_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
