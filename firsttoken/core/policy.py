"""Pure scheduling policy: how many prefill tokens a step takes (core/slo.py orders them)."""

from __future__ import annotations

from dataclasses import dataclass

from firsttoken.core.cost_model import StepCostModel, attention_pairs


@dataclass(frozen=True)
class StepLoad:
    """What a step must serve besides the next prefill chunk."""

    num_decodes: int
    decode_attention_pairs: int
    num_prefill_candidates: int
    head_prefill_context_tokens: int
    head_prefill_remaining_tokens: int


@dataclass(frozen=True)
class LatencyTargets:
    """Bounds on a step that others wait on."""

    # The longest a step may take while decodes (or other prefills) wait on it. A bound in
    # time, not a share of the decodes' own step: a 512-token prompt cut into 128-token
    # pieces re-reads the weights four times and waits behind three extra decode steps, so its
    # TTFT grows by half while the streams' mean TPOT gains nothing (their wait for the
    # prompt's compute is the same, only spread out).
    itl_target_s: float
    min_chunk: int  # fewest prefill tokens a step takes, so prefills progress under any load
    max_chunk: int


def adaptive_prefill_budget(load: StepLoad, cost_model: StepCostModel, targets: LatencyTargets) -> int:
    """Prefill tokens for this step: the largest chunk when nobody else waits on the step,
    otherwise as many as keep the step under the latency target, and never fewer than
    `min_chunk` (so prefills always progress) nor than the cost model's weight-read tokens:
    every extra step re-reads the weights, and on a CPU that reads them slowly against its
    compute (float32 on AVX2: ~70 ms a step for SmolLM2-135M) a finer cut makes the prompt
    wait longer than the streams it spares. A head prompt whose remainder would leave a tail
    shorter than that floor takes the tail now: a step of its own would cost a weight read for
    little work."""
    if load.num_decodes == 0 and load.num_prefill_candidates <= 1:
        return targets.max_chunk
    affordable = cost_model.max_prefill_tokens(
        targets.itl_target_s,
        load.num_decodes,
        load.decode_attention_pairs,
        load.head_prefill_context_tokens,
    )
    floor = min(targets.max_chunk, max(targets.min_chunk, cost_model.weight_read_tokens()))
    budget = max(floor, min(targets.max_chunk, affordable))
    if budget < load.head_prefill_remaining_tokens < budget + floor:
        return min(targets.max_chunk, load.head_prefill_remaining_tokens)
    return budget


@dataclass(frozen=True)
class PrefillPlan:
    """The chunks `auto` would cut one prompt into under a steady load, and each step's cost."""

    chunk_tokens: list[int]
    step_seconds: list[float]

    @property
    def prefill_seconds(self) -> float:
        """From the first chunk's step to the last one's end: the prompt's TTFT, queueing aside."""
        return sum(self.step_seconds)


def plan_prefill(
    prompt_tokens: int,
    num_decodes: int,
    decode_context_tokens: int,
    cost_model: StepCostModel,
    targets: LatencyTargets,
) -> PrefillPlan:
    """Step by step, the budget `adaptive_prefill_budget` gives a lone prompt while
    `num_decodes` streams of `decode_context_tokens` tokens decode beside it."""
    decode_pairs = num_decodes * (decode_context_tokens + 1)
    chunks: list[int] = []
    seconds: list[float] = []
    computed = 0
    while computed < prompt_tokens:
        load = StepLoad(num_decodes, decode_pairs, 1, computed, prompt_tokens - computed)
        chunk = min(adaptive_prefill_budget(load, cost_model, targets), prompt_tokens - computed)
        pairs = decode_pairs + attention_pairs(computed, chunk)
        chunks.append(chunk)
        seconds.append(cost_model.predict(num_decodes + chunk, pairs))
        computed += chunk
    return PrefillPlan(chunks, seconds)
