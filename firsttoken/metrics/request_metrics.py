"""RequestMetrics: one request's TTFT broken into stages, and its decode speed."""

from __future__ import annotations

from dataclasses import dataclass

from firsttoken.request import RequestTimestamps


@dataclass(frozen=True)
class RequestMetrics:
    """Timestamps (perf_counter seconds) and durations (seconds) of one request.

    tokenize + queue + prefill = ttft: arrival -> tokenized -> first scheduled -> first token.
    """

    arrival_time: float
    tokenized_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    last_token_time: float | None
    finished_time: float | None
    num_prompt_tokens: int
    num_generation_tokens: int
    num_cached_tokens: int
    num_prefill_chunks: int
    num_preemptions: int

    @property
    def tokenize_s(self) -> float:
        return self.tokenized_time - self.arrival_time

    @property
    def queue_s(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.tokenized_time

    @property
    def prefill_s(self) -> float | None:
        if self.first_token_time is None or self.first_scheduled_time is None:
            return None
        return self.first_token_time - self.first_scheduled_time

    @property
    def ttft_s(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def decode_s(self) -> float | None:
        if self.first_token_time is None or self.last_token_time is None:
            return None
        return self.last_token_time - self.first_token_time

    @property
    def e2e_s(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time

    @property
    def prefill_tokens_per_s(self) -> float | None:
        prefill = self.prefill_s
        computed = self.num_prompt_tokens - self.num_cached_tokens
        return computed / prefill if prefill else None

    @property
    def decode_tokens_per_s(self) -> float | None:
        decode = self.decode_s
        return (self.num_generation_tokens - 1) / decode if decode else None

    def stage_durations(self) -> dict[str, float | None]:
        return {
            "tokenize_s": self.tokenize_s,
            "queue_s": self.queue_s,
            "prefill_s": self.prefill_s,
            "ttft_s": self.ttft_s,
            "decode_s": self.decode_s,
            "e2e_s": self.e2e_s,
        }

    @classmethod
    def from_timestamps(
        cls,
        timestamps: RequestTimestamps,
        num_prompt_tokens: int,
        num_generation_tokens: int,
        num_cached_tokens: int,
        num_preemptions: int,
    ) -> RequestMetrics:
        return cls(
            arrival_time=timestamps.arrival,
            tokenized_time=timestamps.tokenized if timestamps.tokenized is not None else timestamps.arrival,
            first_scheduled_time=timestamps.first_scheduled,
            first_token_time=timestamps.first_token,
            last_token_time=timestamps.last_token,
            finished_time=timestamps.finished,
            num_prompt_tokens=num_prompt_tokens,
            num_generation_tokens=num_generation_tokens,
            num_cached_tokens=num_cached_tokens,
            num_prefill_chunks=len(timestamps.prefill_chunk_ends),
            num_preemptions=num_preemptions,
        )
