"""Pure scheduling policy: the order prefills are served in and how many tokens a step takes."""

from __future__ import annotations

from dataclasses import dataclass

from firsttoken.request import Request


def prefill_order_key(request: Request, current_step: int, aging_steps: int) -> tuple:
    """Lower priority value first; within a priority, requests that have waited `aging_steps`
    steps go first (oldest first), then fewest remaining prefill tokens, then arrival."""
    waited = current_step - request.enqueued_step
    if waited >= aging_steps:
        return (request.priority, 0, request.enqueued_step, request.timestamps.arrival)
    return (request.priority, 1, request.num_uncomputed_tokens, request.timestamps.arrival)


@dataclass(frozen=True)
class StepCostModel:
    """Predicted seconds of one step on this device:
    fixed + per_token * tokens + per_attention_pair * (sum over tokens of their context length)."""

    seconds_fixed: float
    seconds_per_token: float
    seconds_per_attention_pair: float

    def predict(self, num_tokens: int, num_attention_pairs: int) -> float:
        return (
            self.seconds_fixed
            + self.seconds_per_token * num_tokens
            + self.seconds_per_attention_pair * num_attention_pairs
        )

    def max_prefill_tokens(
        self, seconds: float, num_decodes: int, decode_context_tokens: int, prefill_context_tokens: int
    ) -> int:
        """Largest prefill chunk x whose step (with the decodes) fits in `seconds`.

        A chunk of x tokens after c cached tokens adds x * (c + x / 2) attention pairs, so x
        solves a quadratic; the positive root is taken.
        """
        spare = seconds - self.predict(num_decodes, decode_context_tokens)
        if spare <= 0:
            return 0
        a = self.seconds_per_attention_pair / 2
        b = self.seconds_per_token + self.seconds_per_attention_pair * prefill_context_tokens
        if a <= 0:
            return int(spare / b) if b > 0 else 1 << 30
        return int((-b + (b * b + 4 * a * spare) ** 0.5) / (2 * a))


@dataclass(frozen=True)
class StepLoad:
    """What a step must serve besides the next prefill chunk."""

    num_decodes: int
    decode_context_tokens: int
    num_prefill_candidates: int
    head_prefill_context_tokens: int


def adaptive_prefill_budget(
    load: StepLoad,
    cost_model: StepCostModel,
    itl_target_s: float,
    min_chunk: int,
    max_chunk: int,
) -> int:
    """Prefill tokens for this step: a large chunk when nobody else waits on the step,
    otherwise as many as keep the step under the inter-token-latency target."""
    if load.num_decodes == 0 and load.num_prefill_candidates <= 1:
        return max_chunk
    affordable = cost_model.max_prefill_tokens(
        itl_target_s, load.num_decodes, load.decode_context_tokens, load.head_prefill_context_tokens
    )
    return max(min_chunk, min(max_chunk, affordable))
