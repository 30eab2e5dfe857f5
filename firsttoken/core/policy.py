"""Pure scheduling policy: how many prefill tokens a step takes (core/slo.py orders them)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from firsttoken.core.cost_model import StepCostModel, attention_pairs

# The most times the line's own wait that auto counts a step's delay as lasting (a utilization of 0.9).
MAX_BUSY_PERIOD_FACTOR = 10.0


@dataclass(frozen=True)
class StepLoad:
    """What a step must serve besides the next prefill chunk."""

    num_decodes: int
    decode_attention_pairs: int
    head_prefill_context_tokens: int
    head_prefill_remaining_tokens: int
    # Prompts whose first token each extra step delays: the head, those in line behind it and
    # those expected to arrive while the line is served.
    num_delayed_prompts: float = 1.0
    # Prompts per second lately that would overtake the head at the next step (overtaking_size),
    # so they wait only for the step in flight.
    overtaking_arrivals_per_s: float = 0.0


@dataclass(frozen=True)
class LatencyTargets:
    """Bounds on a step that others wait on, relative to this machine's own decode step."""

    # A step holding prefill tokens takes at most this many times the step of its decodes alone
    # (of one decode when none run). The bound serves two waits: streams stall for no longer,
    # and a prompt arriving during the step waits for no longer. A chunk of that size spends at
    # most 1 / factor of its step on what the step costs anyway (the weights' read, the decodes),
    # which is all that cutting a prompt costs it.
    max_stall_factor: float
    max_step_s: float | None  # an absolute bound on such a step as well, in seconds
    min_chunk: int  # fewest prefill tokens a step takes, so prefills progress under any load
    max_chunk: int


def decode_step_seconds(load: StepLoad, cost_model: StepCostModel) -> float:
    """The step of the running decodes alone (one decode when none run): what each extra step
    of a cut prompt adds to its first token, and the unit the stall bound is counted in."""
    return cost_model.decode_step(load.num_decodes, load.decode_attention_pairs)


def step_limit_seconds(load: StepLoad, cost_model: StepCostModel, targets: LatencyTargets) -> float:
    """The longest a step holding prefill tokens may take under this load.

    Two waits bound it. The stall bound: `max_stall_factor` decode steps, times the square root
    of the prompts an extra step would delay (a cut costs each of them a decode step, so under
    a queue the stall a cut spares costs more first tokens than it saves). The arrivals' bound:
    a prompt that overtakes the head (overtaking_size) and arrives during a step waits half of it on
    average, and each cut costs the delayed prompts a decode step; over a prefill of W seconds
    the cuts cost W * d * n / T and the arrivals' waits W * rate * T / 2, least at
    T = sqrt(2 * d * n / rate)."""
    decode_step_s = decode_step_seconds(load, cost_model)
    num_delayed = max(1.0, load.num_delayed_prompts)
    limit = targets.max_stall_factor * decode_step_s * math.sqrt(num_delayed)
    if load.overtaking_arrivals_per_s > 0:
        limit = min(limit, math.sqrt(2 * decode_step_s * num_delayed / load.overtaking_arrivals_per_s))
    return limit if targets.max_step_s is None else min(limit, targets.max_step_s)


def adaptive_prefill_budget(load: StepLoad, cost_model: StepCostModel, targets: LatencyTargets) -> int:
    """Prefill tokens for this step: as many as keep the step within the stall bound, which is a
    whole prompt whenever it fits (splitting it would only delay its first token), and never
    fewer than `min_chunk` (so prefills always progress) nor than the tokens whose compute costs
    one decode step: a chunk smaller than that spends more of its step on what every step pays
    than on the prompt. A head prompt whose remainder would leave a tail shorter than that floor
    takes the tail now: a step of its own would cost a decode step for little work."""
    decode_step_s = decode_step_seconds(load, cost_model)
    affordable = cost_model.max_prefill_tokens(
        step_limit_seconds(load, cost_model, targets),
        load.num_decodes,
        load.decode_attention_pairs,
        load.head_prefill_context_tokens,
    )
    floor = min(targets.max_chunk, max(targets.min_chunk, cost_model.tokens_costing(decode_step_s)))
    budget = max(floor, min(targets.max_chunk, affordable))
    if budget < load.head_prefill_remaining_tokens < budget + floor:
        return min(targets.max_chunk, load.head_prefill_remaining_tokens)
    return budget


def joins_step(
    num_prompts_in_step: int,
    context_tokens: int,
    num_tokens: int,
    num_sparing: float,
    decode_step_s: float,
    cost_model: StepCostModel,
) -> bool:
    """Whether a further prompt, whose prefill completes in this step, joins a step that already
    holds `num_prompts_in_step` prompts' chunks. Joining delays each of those first tokens by the
    prompt's compute, and spares `num_sparing` prompts one step (a decode step's time): itself,
    those in line behind it and those expected to arrive before the line is served. A first
    token comes no sooner for sharing a step, so on a device that computes a step's tokens one
    after another (a CPU) short prompts fill a step while long ones take steps of their own, the
    first of them answering a whole prefill sooner, until a long queue makes the steps saved
    worth more than the first tokens delayed."""
    compute_s = cost_model.prompt_seconds(num_tokens, context_tokens)
    return num_prompts_in_step * compute_s < decode_step_s * num_sparing


def busy_period_factor(utilization: float) -> float:
    """How many times the line's own wait a step's delay lasts: a step added now delays every
    prompt until the engine catches up with its arrivals, and under utilization rho that busy
    period is 1 / (1 - rho) times the work in hand (M/G/1). Held to `MAX_BUSY_PERIOD_FACTOR`:
    the utilization is an estimate."""
    return min(MAX_BUSY_PERIOD_FACTOR, 1 / max(1e-9, 1 - utilization))


@dataclass(frozen=True)
class StepSharing:
    """Auto's rule for the prompts after the first in a step (joins_step), beside decodes whose
    own step takes `decode_step_s`, with `num_arriving` prompts expected to queue behind and a
    step's delay lasting `busy_factor` times the line's wait (busy_period_factor)."""

    decode_step_s: float
    num_arriving: float
    cost_model: StepCostModel
    busy_factor: float = 1.0

    def joins(self, num_prompts_in_step: int, context_tokens: int, num_tokens: int, num_in_line: int) -> bool:
        """Whether a prompt not started yet, `num_in_line` from the end of the line, completes
        its prefill in this step beside the `num_prompts_in_step` prompts in it: each prompt a
        step saved spares one decode step, for as long as the busy period lasts."""
        num_sparing = (num_in_line + self.num_arriving) * self.busy_factor
        return joins_step(
            num_prompts_in_step, context_tokens, num_tokens, num_sparing, self.decode_step_s, self.cost_model
        )

    def max_started_tokens(self, num_prompts_in_step: int, context_tokens: int, num_in_line: int) -> int:
        """Tokens a prompt already started may add to the step: as many as delay the step's
        prompts by no more than the steps its progress spares the line; a long prompt then
        moves on (if slowly) while shorter ones keep overtaking it. Not stretched by the busy
        period: a long prompt that took the step whole would hold every short one behind it."""
        num_sparing = num_in_line + self.num_arriving
        delay_s = self.decode_step_s * num_sparing / num_prompts_in_step
        return self.cost_model.max_prefill_tokens(
            self.cost_model.seconds_fixed + delay_s, 0, 0, context_tokens
        )


def overtaking_size(num_head_tokens: int) -> int:
    """Prompts shorter than this count as overtaking a head prompt with `num_head_tokens` left:
    half of them. One about as long gains little by going first, its own prefill delaying the
    head by about what it saves."""
    return num_head_tokens // 2


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
        load = StepLoad(num_decodes, decode_pairs, computed, prompt_tokens - computed)
        chunk = min(adaptive_prefill_budget(load, cost_model, targets), prompt_tokens - computed)
        chunks.append(chunk)
        prefill_pairs = attention_pairs(computed, chunk)
        seconds.append(cost_model.predict(chunk, prefill_pairs, num_decodes, decode_pairs))
        computed += chunk
    return PrefillPlan(chunks, seconds)
