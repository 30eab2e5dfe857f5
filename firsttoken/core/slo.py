"""TTFT objectives: predicting when a waiting request's first token comes, and the order and
step sizes that meet deadlines.

A request with an objective has a deadline (arrival + its TTFT objective). The scheduler
predicts its first token from the step-cost model: the prefill work queued ahead of it and its
own, cut into steps, each step also carrying the running decodes. Prefills run earliest
deadline first; one predicted on arrival to miss (admitted under the best-effort policy) goes
behind those expected to meet theirs, since serving a lost cause first makes others miss too.
While some prefill in line would miss under the usual chunking (it is at risk), prefills take
whole steps, and decodes sit out as many steps as the deadlines need (the batch cap). Pure
arithmetic over the cost model, no clock: the caller passes `now`.
"""

from __future__ import annotations

from dataclasses import dataclass

from firsttoken.arithmetic import ceil_div
from firsttoken.core.cost_model import StepCostModel, attention_pairs
from firsttoken.request import Request


@dataclass(frozen=True)
class DecodeLoad:
    """The running decodes every prefill step carries: their count and attention pairs."""

    num_decodes: int
    attention_pairs: int

    def capped(self, num_decodes: int) -> DecodeLoad:
        """The load of `num_decodes` of these decodes (each with the mean context)."""
        if self.num_decodes == 0:
            return self
        kept = min(num_decodes, self.num_decodes)
        return DecodeLoad(kept, self.attention_pairs * kept // self.num_decodes)


@dataclass(frozen=True)
class PrefillWork:
    """Prompt tokens a request still has to compute, after `num_computed_tokens` with KV."""

    num_computed_tokens: int
    num_new_tokens: int

    @classmethod
    def of(cls, request: Request, num_cached_tokens: int = 0) -> PrefillWork:
        computed = max(request.num_computed_tokens, num_cached_tokens)
        return cls(computed, request.num_tokens - computed)


def prefill_seconds(
    work: list[PrefillWork], decodes: DecodeLoad, budget: int, cost_model: StepCostModel
) -> float:
    """Seconds to compute `work` in order, `budget` prefill tokens a step, every step carrying
    `decodes`: short prompts share a step, long ones take several, each step pays the fixed cost."""
    finish = queue_finish_seconds(work, decodes, budget, cost_model)
    return finish[-1] if finish else 0.0


def queue_finish_seconds(
    work: list[PrefillWork], decodes: DecodeLoad, budget: int, cost_model: StepCostModel
) -> list[float]:
    """For each item of `work`, seconds from now until its last prompt token is computed, when
    the items run in order, `budget` tokens a step: its step also holds the tokens after it that
    fit, so it ends when that whole step does."""
    budget = max(1, budget)
    step_seconds = cost_model.predict(0, 0, decodes.num_decodes, decodes.attention_pairs)
    total_tokens = sum(item.num_new_tokens for item in work)
    finish = []
    num_tokens = 0
    pair_seconds = 0.0
    for item in work:
        num_tokens += item.num_new_tokens
        pair_seconds += cost_model.seconds_per_attention_pair * attention_pairs(
            item.num_computed_tokens, item.num_new_tokens
        )
        num_steps = ceil_div(num_tokens, budget)
        tokens_by_then = min(total_tokens, num_steps * budget)
        finish.append(num_steps * step_seconds + cost_model.seconds_per_token * tokens_by_then + pair_seconds)
    return finish


def deadline(request: Request) -> float | None:
    """When its first token is due (perf_counter seconds); None without an objective."""
    if request.ttft_slo_s is None:
        return None
    return request.timestamps.arrival + request.ttft_slo_s


def slack_seconds(request: Request, now: float, own_prefill_s: float) -> float | None:
    """Time to spare were it served next: its deadline less now and its own prefill."""
    due = deadline(request)
    if due is None:
        return None
    return due - now - own_prefill_s


def expected_on_time(request: Request) -> bool:
    """Whether it holds an objective it was not predicted on arrival to miss."""
    if request.ttft_slo_s is None:
        return False
    return request.predicted_ttft_s is None or request.predicted_ttft_s <= request.ttft_slo_s


# Order classes within a priority: aged requests first (nothing starves), then the requests
# expected to meet their objective, earliest deadline first (a later arrival with the same
# objective queues behind, so a prediction made on arrival holds; one that slipped past its
# deadline keeps its place, so it misses by little), then best-effort ones (no objective, or
# predicted on arrival to miss it) by fewest remaining tokens.
AGED, ON_TIME, BEST_EFFORT = 0, 1, 2


def slo_order_key(request: Request, current_step: int, aging_steps: int) -> tuple:
    """Sort key of a prefill candidate: lower runs first."""
    if current_step - request.waiting_since_step >= aging_steps:
        return (request.priority, AGED, request.waiting_since_step, request.timestamps.arrival)
    due = deadline(request)
    if due is not None and expected_on_time(request):
        return (request.priority, ON_TIME, due, request.num_uncomputed_tokens, request.timestamps.arrival)
    return (request.priority, BEST_EFFORT, request.num_uncomputed_tokens, request.timestamps.arrival)


def order_class(key: tuple) -> int:
    """AGED, ON_TIME or BEST_EFFORT: the class of a `slo_order_key`."""
    return key[1]


@dataclass(frozen=True)
class QueuedPrefill:
    """A prefill in line, with the deadline it must meet (None: best effort, no deadline held)."""

    work: PrefillWork
    due: float | None


def misses_a_deadline(
    queue: list[QueuedPrefill], now: float, decodes: DecodeLoad, budget: int, cost_model: StepCostModel
) -> bool:
    """Whether served in order, `budget` prefill tokens a step beside `decodes`, some prefill in
    `queue` finishes after its deadline."""
    finish = queue_finish_seconds([item.work for item in queue], decodes, budget, cost_model)
    return any(item.due is not None and now + seconds > item.due for item, seconds in zip(queue, finish))


def decodes_within_deadlines(
    queue: list[QueuedPrefill],
    now: float,
    decodes: DecodeLoad,
    max_num_batched_tokens: int,
    cost_model: StepCostModel,
) -> int:
    """The most decodes that may share the (whole) prefill steps of `queue` while every
    prefill in it still meets its deadline (the batch cap); 0 when some miss even with none."""
    low, high = 0, decodes.num_decodes
    while low < high:
        middle = (low + high + 1) // 2
        kept = decodes.capped(middle)
        budget = max(1, max_num_batched_tokens - kept.num_decodes)
        if misses_a_deadline(queue, now, kept, budget, cost_model):
            high = middle - 1
        else:
            low = middle
    return low


# The share of a deadline's spare time a rush step may fill with later prompts' tokens; the rest
# absorbs the cost model's error (steps vary by tens of percent on a busy machine).
SPARE_SHARE_FOR_PACKING = 0.5


def rush_prefill_budget(
    queue: list[QueuedPrefill], now: float, decodes: DecodeLoad, max_budget: int, cost_model: StepCostModel
) -> int:
    """Prefill tokens of a step while the queue is at risk: whole steps, except that the step
    that completes the first prefill holding a deadline takes tokens after it only as far as
    that deadline allows (a full step of someone else's tokens would delay its first token by
    their compute)."""
    num_tokens = 0
    pairs = 0
    for item in queue:
        num_tokens += item.work.num_new_tokens
        pairs += attention_pairs(item.work.num_computed_tokens, item.work.num_new_tokens)
        if num_tokens >= max_budget:
            return max_budget
        if item.due is not None:
            break
    else:
        return max_budget
    step_seconds = cost_model.predict(num_tokens, pairs, decodes.num_decodes, decodes.attention_pairs)
    spare_seconds = item.due - now - step_seconds
    if spare_seconds <= 0 or cost_model.seconds_per_token <= 0:
        return max(1, num_tokens)
    extra_seconds = SPARE_SHARE_FOR_PACKING * spare_seconds
    return min(max_budget, num_tokens + int(extra_seconds / cost_model.seconds_per_token))
