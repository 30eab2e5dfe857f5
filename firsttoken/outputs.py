"""What a request gives back: streamed deltas, and the accumulated RequestOutput."""

from __future__ import annotations

from dataclasses import dataclass, field

from firsttoken.core.batch import SampledToken
from firsttoken.metrics.request_metrics import RequestMetrics


@dataclass
class RequestDelta:
    """New tokens and text of one request since its previous delta."""

    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[SampledToken] | None
    finished: bool
    finish_reason: str | None
    stop_reason: int | str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    metrics: RequestMetrics


@dataclass
class RequestOutput:
    """A request's whole result (`LLM.generate`)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[SampledToken] | None = None
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None

    def add(self, delta: RequestDelta) -> None:
        self.token_ids.extend(delta.token_ids)
        self.text += delta.text
        if delta.logprobs is not None:
            self.logprobs = (self.logprobs or []) + delta.logprobs
        self.finished = delta.finished
        self.finish_reason = delta.finish_reason
        self.stop_reason = delta.stop_reason
        self.num_cached_tokens = delta.num_cached_tokens
        self.metrics = delta.metrics
