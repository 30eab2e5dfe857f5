"""The recent arrivals the adaptive chunk policy weighs: how often prompts come, and how long."""

from __future__ import annotations

from collections import deque

# Arrivals this close together are one event (a batch, a burst of retries), not a rate.
BURST_S = 0.01


class ArrivalRate:
    """Owns the arrival times and prompt sizes of the latest requests, and whether each found
    the engine idle: their rate, over at most `window` of them and `horizon_s` seconds."""

    def __init__(self, window: int = 32, horizon_s: float = 60.0) -> None:
        self.horizon_s = horizon_s
        self._arrivals: deque[tuple[float, int, bool]] = deque(maxlen=window)

    def record(self, arrival: float, num_prompt_tokens: int, found_idle: bool) -> None:
        self._arrivals.append((arrival, num_prompt_tokens, found_idle))

    def per_second(self, now: float) -> float:
        """Arrival events per second lately, the gap since the last one counted, at which
        prompts come while the engine works; 0 with fewer than two in the horizon. Arrivals
        within `BURST_S` of the one before are one event: a batch sent at once is already in
        line, not a rate that goes on. Where every recent arrival found the engine idle, none
        came while it worked: a client that sends each request after the last one finished
        (`LLM.generate` in a loop), or a load too light to meet a prompt in flight; so 0."""
        recent = self._recent(now)
        if all(found_idle for _, _, found_idle in recent):
            return 0.0
        times = sorted(arrival for arrival, _, _ in recent)
        num_gaps = sum(1 for earlier, later in zip(times, times[1:]) if later - earlier > BURST_S)
        span_s = max(now, times[-1]) - times[0]
        return num_gaps / span_s if num_gaps and span_s > 0 else 0.0

    def mean_prompt_tokens(self, now: float) -> float:
        """The recent arrivals' mean prompt length; 0 without any."""
        recent = self._recent(now)
        return sum(size for _, size, _ in recent) / len(recent) if recent else 0.0

    def share_shorter_than(self, now: float, num_tokens: int) -> float:
        """The share of the recent arrivals whose prompt was shorter than `num_tokens`."""
        recent = self._recent(now)
        if not recent:
            return 0.0
        return sum(1 for _, size, _ in recent if size < num_tokens) / len(recent)

    def _recent(self, now: float) -> list[tuple[float, int, bool]]:
        return [entry for entry in self._arrivals if entry[0] >= now - self.horizon_s]
