"""Pure scheduling policy: the order prefills are served in and how many tokens a step takes."""

from __future__ import annotations

from dataclasses import dataclass

from firsttoken.core.cost_model import StepCostModel
from firsttoken.request import Request


def prefill_order_key(request: Request, current_step: int, aging_steps: int) -> tuple:
    """Lower priority value first; within a priority, requests that have gone `aging_steps`
    steps without prefill progress go first (longest starved first), then fewest remaining
    prefill tokens, then arrival. A long prompt that gets a chunk starts waiting afresh, so
    once aged it takes one step's budget, not every step's."""
    waited = current_step - request.waiting_since_step
    if waited >= aging_steps:
        return (request.priority, 0, request.waiting_since_step, request.timestamps.arrival)
    return (request.priority, 1, request.num_uncomputed_tokens, request.timestamps.arrival)


@dataclass(frozen=True)
class StepLoad:
    """What a step must serve besides the next prefill chunk."""

    num_decodes: int
    decode_attention_pairs: int
    num_prefill_candidates: int
    head_prefill_context_tokens: int


@dataclass(frozen=True)
class LatencyTargets:
    """Bounds on a step that decodes are waiting on."""

    itl_target_s: float  # absolute bound
    itl_slowdown: float  # bound relative to the same decodes' step without prefill
    min_chunk: int
    max_chunk: int


def step_time_target(load: StepLoad, cost_model: StepCostModel, targets: LatencyTargets) -> float:
    """The longest a step may take: the absolute target, tightened to `itl_slowdown` times
    a decode-only step when decodes run."""
    if load.num_decodes == 0:
        return targets.itl_target_s
    decode_only = cost_model.predict(load.num_decodes, load.decode_attention_pairs)
    return min(targets.itl_target_s, targets.itl_slowdown * decode_only)


def adaptive_prefill_budget(load: StepLoad, cost_model: StepCostModel, targets: LatencyTargets) -> int:
    """Prefill tokens for this step: the largest chunk when nobody else waits on the step,
    otherwise as many as keep the step under its latency target (at least `min_chunk`, so
    prefills always progress)."""
    if load.num_decodes == 0 and load.num_prefill_candidates <= 1:
        return targets.max_chunk
    affordable = cost_model.max_prefill_tokens(
        step_time_target(load, cost_model, targets),
        load.num_decodes,
        load.decode_attention_pairs,
        load.head_prefill_context_tokens,
    )
    return max(targets.min_chunk, min(targets.max_chunk, affordable))
