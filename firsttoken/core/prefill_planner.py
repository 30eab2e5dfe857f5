"""Prefill planning: how many prompt tokens a step takes, against the latency targets and the
requests' TTFT objectives.

Usually a step's prefill budget is the chunk policy's (core/policy.py): a fixed chunk, or with
`chunk_size` auto what keeps the step within the latency targets given the line and the prompts
expected to arrive behind it. A request with a TTFT objective is predicted on arrival from the
step-cost model (core/slo.py) and, under the "refuse" policy, refused when it would miss. While
some prefill in line would miss under the usual budget (it is at risk), prefills take whole
steps and only as many decodes share them as the deadlines allow (the batch cap). The scheduler
owns the queues and hands over what is in line; this module decides the budgets.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Callable

from firsttoken.config import ChunkedPrefillConfig, SchedulerConfig
from firsttoken.core.arrival_rate import ArrivalRate
from firsttoken.core.cost_model import StepTimeTracker
from firsttoken.core.policy import (
    LatencyTargets,
    StepLoad,
    StepSharing,
    adaptive_prefill_budget,
    busy_period_factor,
    decode_step_seconds,
    overtaking_size,
    step_limit_seconds,
)
from firsttoken.core.slo import (
    ON_TIME,
    DecodeLoad,
    PrefillWork,
    QueuedPrefill,
    deadline,
    decodes_within_deadlines,
    misses_a_deadline,
    order_class,
    prefill_seconds,
    queue_finish_seconds,
    rush_prefill_budget,
    slack_seconds,
)
from firsttoken.errors import SloUnattainableError
from firsttoken.request import Request

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefillLine:
    """The requests with prompt tokens to compute, in order, each with its order key
    (slo.slo_order_key), and the decodes each of their steps carries."""

    candidates: list[tuple[Request, tuple]]
    decodes: DecodeLoad

    @property
    def requests(self) -> list[Request]:
        return [request for request, _ in self.candidates]


class PrefillPlanner:
    """Owns the step-cost model and the recent arrivals, and sizes each step's prefill by them."""

    def __init__(
        self,
        config: SchedulerConfig,
        chunked_prefill: ChunkedPrefillConfig,
        step_times: StepTimeTracker | None,
        clock: Callable[[], float],
    ) -> None:
        self.config = config
        self.chunked_prefill = chunked_prefill
        self.step_times = step_times
        self.clock = clock
        self.arrival_rate = ArrivalRate()

    def record_arrival(self, request: Request, found_idle: bool) -> None:
        """Count an admitted request among the arrivals auto weighs; `found_idle`: no other
        request was in the engine when it came."""
        self.arrival_rate.record(request.timestamps.arrival, request.num_prompt_tokens, found_idle)

    # -- TTFT objectives -------------------------------------------------------------------

    def predict_ttft(self, request: Request, own: PrefillWork, key: tuple, line: PrefillLine) -> None:
        """Give a request holding an objective its predicted TTFT: the time it has waited, then
        the prefills in `line` ordered before it (by `key`, its order key) and its own (`own`) in
        whole steps beside the line's decodes. Under the refuse policy one predicted to miss is
        refused (SloUnattainableError), with how long until it would not."""
        assert request.ttft_slo_s is not None and self.step_times is not None
        now = self.clock()
        cost_model = self.step_times.model
        ahead = [(r, r_key) for r, r_key in line.candidates if r_key <= key]
        queue = [*self._queued_prefills(ahead, now), QueuedPrefill(own, deadline(request))]
        in_line = [r for r, _ in ahead] + [request] + [r for r, _ in line.candidates[len(ahead) :]]
        decodes = line.decodes
        if self._at_risk(queue, now, decodes, in_line):
            max_tokens = self.config.max_num_batched_tokens
            decodes = decodes.capped(decodes_within_deadlines(queue, now, decodes, max_tokens, cost_model))
            budget = self._max_prefill_tokens(decodes)
        else:
            budget = self.prefill_budget(decodes, in_line)
        finish = queue_finish_seconds([item.work for item in queue], decodes, budget, cost_model)
        request.predicted_ttft_s = now - request.timestamps.arrival + finish[-1]
        excess_s = request.predicted_ttft_s - request.ttft_slo_s
        if self.config.slo_policy == "refuse" and excess_s > 0:
            raise SloUnattainableError(
                f"ttft_slo_ms: the first token is predicted in {request.predicted_ttft_s * 1000:.0f} ms "
                f"({len(ahead)} prefills ahead), past the objective of {request.ttft_slo_s * 1000:g} ms",
                retry_after_s=max(1, math.ceil(excess_s)),
            )

    def rush_decode_cap(self, line: PrefillLine) -> int | None:
        """None when every prefill in `line` meets its objective (or has none) under the usual
        chunking; otherwise prefills take whole steps, and this is how many of the line's decodes
        may share them while those prefills still meet theirs (the batch cap)."""
        if self.step_times is None:
            return None
        now = self.clock()
        queue = self._queued_prefills(line.candidates, now)
        if not self._at_risk(queue, now, line.decodes, line.requests):
            return None
        max_tokens = self.config.max_num_batched_tokens
        return decodes_within_deadlines(queue, now, line.decodes, max_tokens, self.step_times.model)

    def rush_prefill_budget(self, line: PrefillLine) -> int:
        """Prefill tokens of a step beside the line's decodes (those scheduled) while prefills
        are at risk."""
        assert self.step_times is not None  # a rush needs the cost model
        now = self.clock()
        queue = self._queued_prefills(line.candidates, now)
        max_budget = self.config.max_num_batched_tokens - line.decodes.num_decodes
        return rush_prefill_budget(queue, now, line.decodes, max_budget, self.step_times.model)

    def _queued_prefills(self, candidates: list[tuple[Request, tuple]], now: float) -> list[QueuedPrefill]:
        """The candidates up to the last one holding a deadline: each with its deadline if it is
        expected on time and could still meet it were it served next (a slipped one holds none,
        or the queue would look at risk, and decodes sit out steps, until it is served)."""
        queue = []
        for request, key in candidates:
            work = PrefillWork.of(request)
            holds_deadline = False
            if order_class(key) == ON_TIME:
                slack = slack_seconds(request, now, self._best_case_prefill_seconds(work))
                holds_deadline = slack is not None and slack >= 0
            queue.append(QueuedPrefill(work, deadline(request) if holds_deadline else None))
        while queue and queue[-1].due is None:
            queue.pop()
        return queue

    def _at_risk(
        self, queue: list[QueuedPrefill], now: float, decodes: DecodeLoad, in_line: list[Request]
    ) -> bool:
        """Whether under the usual budget some prefill in `queue` (the first of the prefills
        `in_line`) would miss its deadline."""
        if self.step_times is None or not queue:
            return False
        usual = self.prefill_budget(decodes, in_line)
        return misses_a_deadline(queue, now, decodes, usual, self.step_times.model)

    def _max_prefill_tokens(self, decodes: DecodeLoad) -> int:
        """Prefill tokens a step holds when a prefill takes the whole step beside the decodes."""
        return max(1, self.config.max_num_batched_tokens - decodes.num_decodes)

    def _best_case_prefill_seconds(self, work: PrefillWork) -> float:
        """Its prefill were it served next in whole steps, every decode sitting out."""
        if self.step_times is None:
            return 0.0
        no_decodes = DecodeLoad(0, 0)
        budget = self._max_prefill_tokens(no_decodes)
        return prefill_seconds([work], no_decodes, budget, self.step_times.model)

    # -- the usual budget --------------------------------------------------------------------

    @property
    def latency_targets(self) -> LatencyTargets:
        """The bounds `auto` sizes prefill chunks within."""
        max_chunk = self.config.max_num_batched_tokens
        itl_target_ms = self.chunked_prefill.itl_target_ms
        return LatencyTargets(
            max_stall_factor=self.chunked_prefill.max_stall_factor,
            max_step_s=None if itl_target_ms is None else itl_target_ms / 1000,
            min_chunk=min(self.chunked_prefill.min_chunk_size, max_chunk),
            max_chunk=max_chunk,
        )

    def prefill_budget(self, decodes: DecodeLoad, candidates: list[Request]) -> int:
        """The usual prefill tokens of a step beside `decodes`, with `candidates` in line for
        prefill, in order."""
        max_chunk = self.config.max_num_batched_tokens
        chunk_size = self.chunked_prefill.chunk_size
        if not self.chunked_prefill.enable:
            return max_chunk
        if chunk_size != "auto":
            return min(chunk_size, max_chunk)
        if self.step_times is None:
            return max_chunk
        head_holds_deadline = bool(candidates) and candidates[0].ttft_slo_s is not None
        if decodes.num_decodes == 0 and head_holds_deadline:
            # Deadlines order this line, and no stream stalls: a cut would only cost it a step.
            return max_chunk
        head_remaining = candidates[0].num_uncomputed_tokens if candidates else 0
        if head_holds_deadline:
            # Earliest deadline first: nobody overtakes, and the objectives' predictions count
            # the stall bound alone (the line's length would change it under them).
            num_delayed, overtaking_per_s = 1.0, 0.0
        else:
            num_delayed = len(candidates) + self._arrivals_behind(candidates, decodes)
            overtaking_per_s = self._overtaking_rate(head_remaining)
        load = StepLoad(
            num_decodes=decodes.num_decodes,
            decode_attention_pairs=decodes.attention_pairs,
            head_prefill_context_tokens=candidates[0].num_computed_tokens if candidates else 0,
            head_prefill_remaining_tokens=head_remaining,
            num_delayed_prompts=num_delayed,
            overtaking_arrivals_per_s=overtaking_per_s,
        )
        budget = adaptive_prefill_budget(load, self.step_times.model, self.latency_targets)
        logger.debug("prefill budget %d for %s", budget, load)
        return budget

    def step_sharing(self, decodes: DecodeLoad, candidates: list[Request]) -> StepSharing | None:
        """Auto's rule for further prompts to share a step beside `decodes`, with `candidates` in
        line for prefill; None where chunks are fixed, without a cost model, or when a prompt in
        line holds a TTFT objective: deadlines then order the line, and the objectives'
        predictions count its prompts sharing steps."""
        chunked = self.chunked_prefill
        if not chunked.enable or chunked.chunk_size != "auto" or self.step_times is None:
            return None
        if any(request.ttft_slo_s is not None for request in candidates):
            return None
        cost_model = self.step_times.model
        decode_step_s = decode_step_seconds(
            StepLoad(decodes.num_decodes, decodes.attention_pairs, 0, 0), cost_model
        )
        num_arriving = self._arrivals_behind(candidates, decodes)
        busy_factor = busy_period_factor(self._prefill_utilization(decode_step_s))
        return StepSharing(decode_step_s, num_arriving, cost_model, busy_factor)

    def _prefill_utilization(self, decode_step_s: float) -> float:
        """The share of the engine's time the recent arrivals' prefills take when each takes a
        step of its own: the arrival rate times a mean prompt's compute and a decode step. It
        leaves out their decodes, so it errs low, toward fewer shared steps."""
        assert self.step_times is not None
        now = self.clock()
        cost_model = self.step_times.model
        prompt_s = cost_model.prompt_seconds(round(self.arrival_rate.mean_prompt_tokens(now)))
        return self.arrival_rate.per_second(now) * (prompt_s + decode_step_s)

    def _arrivals_behind(self, candidates: list[Request], decodes: DecodeLoad) -> float:
        """Prompts expected to arrive, at the recent rate, while the line's prefills run in steps
        of their own beside `decodes`, and to queue behind its head: all but those that overtake
        it (policy.overtaking_size), which wait only for the step in flight."""
        if not candidates:
            return 0.0
        assert self.step_times is not None  # auto's rules need the cost model
        cost_model = self.step_times.model
        decode_step_s = decode_step_seconds(
            StepLoad(decodes.num_decodes, decodes.attention_pairs, 0, 0), cost_model
        )
        num_line_tokens = sum(request.num_uncomputed_tokens for request in candidates)
        line_s = cost_model.seconds_per_token * num_line_tokens + decode_step_s * len(candidates)
        now = self.clock()
        overtaking = overtaking_size(candidates[0].num_uncomputed_tokens)
        share_behind = 1 - self.arrival_rate.share_shorter_than(now, overtaking)
        return self.arrival_rate.per_second(now) * share_behind * line_s

    def _overtaking_rate(self, num_head_tokens: int) -> float:
        """Prompts per second lately that would overtake a head with `num_head_tokens` left."""
        now = self.clock()
        share_overtaking = self.arrival_rate.share_shorter_than(now, overtaking_size(num_head_tokens))
        return self.arrival_rate.per_second(now) * share_overtaking

    def describe_chunking(self) -> str:
        """One line for the start-up log: how prompts are cut into steps, and the figures behind it."""
        chunked = self.chunked_prefill
        max_chunk = self.config.max_num_batched_tokens
        if not chunked.enable:
            return "chunked prefill off: each prompt in one step (one past max_num_batched_tokens alone)"
        if chunked.chunk_size != "auto":
            return f"chunked prefill: fixed chunks of {min(chunked.chunk_size, max_chunk)} tokens"
        if self.step_times is None:
            return f"chunked prefill auto without a step-cost model: steps of up to {max_chunk} tokens"
        cost_model = self.step_times.model
        load = StepLoad(1, 1, 0, max_chunk)
        budget = adaptive_prefill_budget(load, cost_model, self.latency_targets)
        decode_step_ms = decode_step_seconds(load, cost_model) * 1000
        limit_ms = step_limit_seconds(load, cost_model, self.latency_targets) * 1000
        return (
            f"chunked prefill auto: a step with prompt tokens takes at most {chunked.max_stall_factor:g}x "
            f"its decodes' own step (one decode: {decode_step_ms:.1f} ms here, so {limit_ms:.0f} ms, "
            f"{budget} prompt tokens); longer with more decodes or a queue behind the prompt, shorter "
            "while shorter prompts keep arriving"
        )
