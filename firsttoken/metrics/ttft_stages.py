"""TTFTStages: one request's time to first token as seen by the front end, split into stages."""

from __future__ import annotations

from dataclasses import dataclass

from firsttoken.outputs import RequestMetrics


@dataclass(frozen=True)
class TTFTStages:
    """Where one request's time to its first token went, in seconds (None: not reached).

    tokenize_s + queue_s + prefill_s + first_token_handoff_s = ttft_s. `prefill_s` ends when
    the engine stamped the first token, so it holds the first token's sampling too;
    `first_token_handoff_s` is what follows: detokenizing and the hop from the engine thread
    to the asyncio thread that sends it.
    """

    tokenize_s: float
    queue_s: float | None
    prefill_s: float | None
    first_token_handoff_s: float | None
    ttft_s: float | None
    num_cached_tokens: int

    @classmethod
    def from_metrics(cls, metrics: RequestMetrics, first_token_received_time: float | None) -> TTFTStages:
        """Stages from the engine's timestamps and when the first token reached the front end."""
        handoff = None
        ttft = None
        if first_token_received_time is not None and metrics.first_token_time is not None:
            handoff = first_token_received_time - metrics.first_token_time
            ttft = first_token_received_time - metrics.arrival_time
        return cls(
            tokenize_s=metrics.tokenize_s,
            queue_s=metrics.queue_s,
            prefill_s=metrics.prefill_s,
            first_token_handoff_s=handoff,
            ttft_s=ttft,
            num_cached_tokens=metrics.num_cached_tokens,
        )

    def durations(self) -> dict[str, float | None]:
        """Stage name (without the `_s`) -> seconds, in the order they happen; TTFT last."""
        return {
            "tokenize": self.tokenize_s,
            "queue": self.queue_s,
            "prefill": self.prefill_s,
            "first_token_handoff": self.first_token_handoff_s,
            "ttft": self.ttft_s,
        }
