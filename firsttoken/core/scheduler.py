"""Scheduler: continuous batching over one counter per request.

Each step serves every running decode first, then fills the rest of the token budget with
prefill chunks in policy order (priority, aging, fewest remaining tokens). With `chunk_size`
auto (core/policy.py) the budget is what keeps the step within a multiple of the decodes' own
step, and a prompt after the first joins the step only when its prefill completes there and
sharing the step spares more first tokens a step than it delays. When KV blocks run
out, the most recently admitted request is preempted: its blocks are freed and it is
recomputed later from its tokens, so every request eventually finishes.

Speculative decoding: a decode may carry draft tokens (proposed by the engine after the
previous step, `Request.draft_token_ids`) that the model verifies in the same step (every row
samples). The scheduler keeps the longest prefix of drafts the model agrees with, plus the
model's own next token: `num_computed_tokens` counts only accepted tokens, so a rejected draft's
KV is never hashed into the prefix cache nor read again, and blocks past the sequence's end go
back to the pool. It verifies drafts only in steps with no prefill waiting (a first token is
never delayed by them) and of at most `max_num_speculating_seqs` decodes.

TTFT objectives (core/slo.py): a request with one is predicted on arrival and, under the
"refuse" policy, refused at once when it would miss; prefills run earliest deadline first, and a
prefill at risk of missing takes whole steps and sits out as many decodes as it must (each
decode sits out at most one step running). The prefill budgets, usual and at risk, and the
predictions are core/prefill_planner.py's; this module keeps the queues and the KV blocks.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Container

from firsttoken.config import ChunkedPrefillConfig, SchedulerConfig
from firsttoken.core.batch import (
    ModelOutput,
    PromptLogprobSpec,
    SampleSpec,
    ScheduledChunk,
    SchedulerOutput,
    TrackedRequest,
)
from firsttoken.core.cost_model import StepTimeTracker
from firsttoken.core.hashing import BlockHash, extend_block_hashes
from firsttoken.core.kv_cache_manager import KVCacheManager
from firsttoken.core.policy import StepSharing
from firsttoken.core.prefill_planner import PrefillLine, PrefillPlanner
from firsttoken.core.slo import DecodeLoad, PrefillWork, slo_order_key
from firsttoken.errors import InvalidInputError, QueueFullError, SloUnattainableError
from firsttoken.outputs import SampledToken
from firsttoken.request import Request, RequestStatus

logger = logging.getLogger(__name__)


@dataclass
class SchedulerStats:
    """Counters over the engine's life."""

    num_preemptions: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_steps: int = 0
    last_prefill_budget: int = 0
    num_slo_refusals: int = 0  # requests refused on arrival: predicted to miss their TTFT objective
    num_deferred_decodes: int = 0  # decodes that sat out a step for an at-risk prefill
    num_drafts: int = 0  # decodes that carried proposals
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # accepted_per_position[i]: drafts whose proposal i + 1 was accepted
    accepted_per_position: list[int] = field(default_factory=list)


@dataclass
class RequestProgress:
    """What one step did to one request: the tokens it appended, in order (several when it
    verified proposals)."""

    request: Request
    sampled: list[SampledToken]


@dataclass(frozen=True)
class DraftSlot:
    """A decode the next step may verify drafts for, and how many draft tokens it has room for."""

    request: Request
    max_tokens: int


class Scheduler:
    """Owns the waiting and running queues and every live Request."""

    def __init__(
        self,
        config: SchedulerConfig,
        chunked_prefill: ChunkedPrefillConfig,
        kv_manager: KVCacheManager,
        max_model_len: int,
        hash_root: BlockHash,
        step_times: StepTimeTracker | None = None,
        max_num_speculating_seqs: int = 0,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        """`step_times`: this device's measured step cost, which sizes prefill chunks when the
        chunk size is auto (without it an auto step takes the whole token budget) and predicts
        TTFTs against objectives (without it objectives only order prefills, by deadline).
        Drafts are verified in steps of at most `max_num_speculating_seqs` decodes (0: never).
        `clock`: the time requests' stamps are read on (perf_counter seconds)."""
        if config.max_num_batched_tokens < config.max_num_seqs:
            raise InvalidInputError(
                "max_num_batched_tokens",
                f"must be >= max_num_seqs ({config.max_num_seqs}) so that every running decode fits "
                f"in a step, got {config.max_num_batched_tokens}",
            )
        self.config = config
        self.chunked_prefill = chunked_prefill
        self.kv_manager = kv_manager
        self.block_size = kv_manager.block_size
        self.max_model_len = max_model_len
        self.hash_root = hash_root
        self.prefill_planner = PrefillPlanner(config, chunked_prefill, step_times, clock)
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.step_index = 0
        self.stats = SchedulerStats()
        self.max_num_speculating_seqs = max_num_speculating_seqs
        self.clock = clock
        self._drafts: dict[str, list[int]] = {}  # this step's drafts, by request
        # Tracked requests (see TrackedRequest) admitted but not yet sent to the sampler, and
        # those sent whose end the sampler has not been told of.
        self._unsent_tracked: dict[str, TrackedRequest] = {}
        self._finished_tracked: list[str] = []

    @property
    def step_times(self) -> StepTimeTracker | None:
        """This device's measured step cost, which the prefill planner sizes steps by."""
        return self.prefill_planner.step_times

    # -- requests in and out -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        self.validate_capacity(
            request.num_prompt_tokens, request.max_total_tokens - request.num_prompt_tokens
        )
        if request.req_id in self.requests:
            raise InvalidInputError("req_id", f"{request.req_id!r} is already in use")
        limit = self.config.max_waiting_requests
        if limit is not None and len(self.waiting) >= limit:
            raise QueueFullError(f"the waiting queue is full ({limit} requests)")
        extend_block_hashes(request.block_hashes, request.token_ids, self.block_size, self.hash_root)
        request.waiting_since_step = self.step_index
        try:
            self._check_fits_beside_pins(request)
            self._predict_ttft(request)
        except (InvalidInputError, SloUnattainableError):
            request.block_hashes.clear()
            raise
        found_idle = not self.requests
        self.requests[request.req_id] = request
        self.waiting.append(request)
        self.prefill_planner.record_arrival(request, found_idle)

    def validate_capacity(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Raise InvalidInputError if a request of this size could never run, whatever the load."""
        if num_prompt_tokens < 1:
            raise InvalidInputError("prompt", "must hold at least one token")
        total = num_prompt_tokens + max_tokens
        if total > self.max_model_len:
            raise InvalidInputError(
                "max_tokens",
                f"prompt ({num_prompt_tokens} tokens) plus max_tokens ({max_tokens}) is {total}, "
                f"longer than max_model_len ({self.max_model_len})",
            )
        needed = self.kv_manager.max_blocks_held(total, self.config.max_num_batched_tokens)
        if needed > self.kv_manager.num_blocks:
            raise InvalidInputError(
                "max_tokens",
                f"prompt plus max_tokens needs {needed} KV blocks, but the KV cache holds "
                f"{self.kv_manager.num_blocks}; raise kv_cache_memory_bytes or lower max_tokens",
            )

    def _check_fits_beside_pins(self, request: Request) -> None:
        """Pinned blocks are never evicted: a request needing more than the rest of the cache
        (its own pinned prefix aside) could never be scheduled, so it is refused now rather
        than left waiting until someone unpins."""
        num_needed = self.kv_manager.max_blocks_held(
            request.max_total_tokens, self.config.max_num_batched_tokens
        )
        num_pinned = self.kv_manager.num_pinned_blocks_apart_from(request.block_hashes)
        num_available = self.kv_manager.num_blocks - num_pinned
        if num_needed > num_available:
            raise InvalidInputError(
                "max_tokens",
                f"prompt plus max_tokens needs {num_needed} KV blocks, but pinned prefixes hold "
                f"{num_pinned} of the {self.kv_manager.num_blocks}, leaving {num_available}; lower "
                "max_tokens or unpin a prefix",
            )

    def _predict_ttft(self, request: Request) -> None:
        """Give the request its objective and, with a cost model, its predicted TTFT; under the
        refuse policy one predicted to miss is refused (PrefillPlanner.predict_ttft)."""
        if request.ttft_slo_s is None and self.config.ttft_slo_ms is not None:
            request.ttft_slo_s = self.config.ttft_slo_ms / 1000
        if request.ttft_slo_s is None or self.step_times is None:
            return
        num_cached_tokens = len(self.kv_manager.find_cached_prefix(request)) * self.block_size
        own = PrefillWork.of(request, num_cached_tokens)
        key = slo_order_key(request, self.step_index, self.chunked_prefill.aging_steps)
        line = PrefillLine(self._ordered_candidates(), self._decode_load())
        try:
            self.prefill_planner.predict_ttft(request, own, key, line)
        except SloUnattainableError:
            self.stats.num_slo_refusals += 1
            raise

    def _decode_load(self) -> DecodeLoad:
        decoding = self._decoding()
        return DecodeLoad(len(decoding), sum(r.num_computed_tokens + 1 for r in decoding))

    def expire_waiting(self, exempt: Container[str] = ()) -> list[Request]:
        """End the requests that waited longer than max_queue_wait_s for their first step; they
        free whatever they held and finish with an error naming the limit. Those in `exempt`
        (the engine's own, such as a pin being computed) wait as long as they must."""
        max_wait_s = self.config.max_queue_wait_s
        if max_wait_s is None:
            return []
        oldest_arrival = self.clock() - max_wait_s
        expired = [
            request for request in self.waiting
            if request.timestamps.first_scheduled is None and request.timestamps.arrival < oldest_arrival
            and request.req_id not in exempt
        ]  # fmt: skip
        for request in expired:
            request.stop_reason = (
                f"max_queue_wait_s: waited more than {max_wait_s:g} s for KV cache room or a free slot"
            )
            self.finish_request(request.req_id, RequestStatus.FINISHED_ERROR)
        return expired

    def finish_request(self, req_id: str, status: RequestStatus) -> Request | None:
        """End a request now (stop string, abort): its blocks go back to the pool."""
        request = self.requests.pop(req_id, None)
        if request is None:
            return None
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv_manager.free(request)
        request.status = status
        request.timestamps.finished = self.clock()
        if request.sampling_params.tracks_tokens:
            self._end_tracking(request)
        return request

    def _end_tracking(self, request: Request) -> None:
        """A tracked request ended: the sampler frees its state, if it was ever sent."""
        was_admitted = request.timestamps.first_scheduled is not None
        was_unsent = self._unsent_tracked.pop(request.req_id, None) is not None
        if was_admitted and not was_unsent:
            self._finished_tracked.append(request.req_id)

    def take_finished_tracked(self) -> list[str]:
        """The tracked requests finished since the last call: the sampler frees their counts."""
        finished, self._finished_tracked = self._finished_tracked, []
        return finished

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -- one step --------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        self.step_index += 1
        scheduled: dict[str, int] = {}
        preempted: list[str] = []
        self._drafts = {}
        planner = self.prefill_planner
        line = PrefillLine(self._startable_candidates(), self._decode_load())
        rush_decode_cap = planner.rush_decode_cap(line)
        self._schedule_decodes(scheduled, preempted, rush_decode_cap)
        num_decode_tokens = len(scheduled) + sum(len(draft) for draft in self._drafts.values())
        sharing = None
        if rush_decode_cap is None:
            candidates = self._prefill_candidates()
            # Every decode left running is scheduled (none sits out outside a rush).
            decodes = DecodeLoad(len(scheduled), self._decode_load().attention_pairs)
            prefill_budget = planner.prefill_budget(decodes, candidates)
            sharing = planner.step_sharing(decodes, candidates)
        else:
            scheduled_decodes = DecodeLoad(
                len(scheduled), sum(self.requests[req_id].num_computed_tokens + 1 for req_id in scheduled)
            )
            line = PrefillLine(self._startable_candidates(), scheduled_decodes)
            prefill_budget = planner.rush_prefill_budget(line)
        token_budget = min(self.config.max_num_batched_tokens, num_decode_tokens + prefill_budget)
        self._schedule_prefills(scheduled, preempted, token_budget - num_decode_tokens, sharing)
        self.stats.last_prefill_budget = prefill_budget
        chunks = self._build_chunks(scheduled)
        # A step without chunks does not reach the worker: its new tracked requests wait for one.
        new_tracked = list(self._unsent_tracked.values()) if chunks else []
        if new_tracked:
            self._unsent_tracked.clear()
        return SchedulerOutput(chunks, new_tracked)

    def _decodes_beside_rush(self, decoding: list[Request], max_decodes: int) -> list[Request]:
        """The decodes that share an at-risk prefill's step: those that sat out the last step,
        then the earliest admitted, up to `max_decodes`; the rest sit this one out."""
        sat_out = {r.req_id for r in decoding if r.decode_deferred_step == self.step_index - 1}
        others = [r for r in decoding if r.req_id not in sat_out]
        kept = sat_out | {r.req_id for r in others[: max(0, max_decodes - len(sat_out))]}
        for request in decoding:
            if request.req_id not in kept:
                request.decode_deferred_step = self.step_index
                self.stats.num_deferred_decodes += 1
        return [r for r in decoding if r.req_id in kept]

    def _schedule_decodes(
        self, scheduled: dict[str, int], preempted: list[str], max_decodes: int | None
    ) -> None:
        decoding = self._decoding()
        if max_decodes is not None and max_decodes < len(decoding):
            decoding = self._decodes_beside_rush(decoding, max_decodes)
        verifies_drafts = self._speculates(len(decoding))
        for request in decoding:
            draft = request.draft_token_ids[: self._draft_room(request)] if verifies_drafts else []
            request.draft_token_ids = []  # a draft is for the step after the one that proposed it
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted for an earlier decode's block
            # Drafts take only free blocks: they never preempt another request.
            if draft and self.kv_manager.allocate_slots(request, 1 + len(draft)):
                self._drafts[request.req_id] = draft
            if self._allocate_or_preempt(request, 1, scheduled, preempted):
                scheduled[request.req_id] = 1
            else:
                self._drafts.pop(request.req_id, None)

    def _decoding(self) -> list[Request]:
        """The running requests whose next step computes one token: their latest sampled one."""
        return [
            request for request in self.running
            if request.status is RequestStatus.RUNNING and request.num_uncomputed_tokens == 1
        ]  # fmt: skip

    def _speculates(self, num_decoding: int) -> bool:
        """Verify drafts this step: few decodes, and no prompt waiting for its prefill."""
        return (
            0 < num_decoding <= self.max_num_speculating_seqs
            and not self.waiting
            and all(request.num_uncomputed_tokens <= 1 for request in self.running)
        )

    def draft_slots(self) -> list[DraftSlot]:
        """The decodes the next step would verify drafts for, were it scheduled now: the engine
        asks its proposer for these after a step's update."""
        decoding = self._decoding()
        if not self._speculates(len(decoding)):
            return []
        slots = [DraftSlot(request, self._draft_room(request)) for request in decoding]
        return [slot for slot in slots if slot.max_tokens > 0]

    @staticmethod
    def _draft_room(request: Request) -> int:
        """How many draft tokens a decode may verify: room for them and the model's own token
        after them; none for a tracked request, whose sampler counts every input token."""
        params = request.sampling_params
        if params.tracks_tokens:
            return 0
        num_room = min(
            params.max_tokens - request.num_output_tokens, request.max_total_tokens - request.num_tokens
        )
        return max(0, num_room - 1)

    def describe_chunking(self) -> str:
        """One line for the start-up log: how prompts are cut into steps."""
        return self.prefill_planner.describe_chunking()

    def observe_step_time(self, output: SchedulerOutput, seconds: float) -> None:
        """Feed a finished step's duration to the cost model's online correction."""
        if self.step_times is not None and not output.is_empty:
            self.step_times.observe(output.chunks, seconds)

    def _prefill_candidates(self) -> list[Request]:
        return [request for request, _ in self._ordered_candidates()]

    def _ordered_candidates(self) -> list[tuple[Request, tuple]]:
        """The requests with prompt tokens to compute, each with its order key, in order."""
        partial = [r for r in self.running if r.num_uncomputed_tokens > 1]
        aging_steps = self.chunked_prefill.aging_steps
        keyed = [(r, slo_order_key(r, self.step_index, aging_steps)) for r in partial + self.waiting]
        keyed.sort(key=lambda pair: pair[1])
        return keyed

    def _startable_candidates(self) -> list[tuple[Request, tuple]]:
        """The ordered candidates this step could compute: every started prompt, and waiting ones
        only while running seats are free (max_num_seqs). A rush for a prompt that cannot start
        would leave decodes sitting out steps that carry nothing else."""
        num_free_seats = self.config.max_num_seqs - len(self.running)
        startable = []
        for request, key in self._ordered_candidates():
            if request.status is not RequestStatus.RUNNING:
                if num_free_seats <= 0:
                    continue
                num_free_seats -= 1
            startable.append((request, key))
        return startable

    def _schedule_prefills(
        self,
        scheduled: dict[str, int],
        preempted: list[str],
        budget: int,
        sharing: StepSharing | None = None,
    ) -> None:
        """Fill `budget` with prefill chunks in policy order. With `sharing` (auto's rule), a
        prompt after the first that has not started joins only if its prefill completes in this
        step and the rule takes it, and the line stops at the first that does not, so none jumps
        it; one already started adds what the rule allows of it."""
        num_prompts_in_step = 0
        candidates = self._prefill_candidates()
        for position, request in enumerate(candidates):
            if budget <= 0:
                break
            if request.req_id in scheduled or request.req_id not in self.requests:
                continue
            num_allowed = budget
            if sharing is not None and num_prompts_in_step > 0:
                num_in_line = len(candidates) - position
                if request.status is RequestStatus.RUNNING:
                    num_allowed = min(
                        budget,
                        sharing.max_started_tokens(
                            num_prompts_in_step, request.num_computed_tokens, num_in_line
                        ),
                    )
                else:
                    num_remaining = self._uncomputed_after_cached_prefix(request)
                    context_tokens = request.num_tokens - num_remaining
                    if num_remaining > budget or not sharing.joins(
                        num_prompts_in_step, context_tokens, num_remaining, num_in_line
                    ):
                        break
            is_first_prefill = num_prompts_in_step == 0
            if request.status is RequestStatus.RUNNING:
                num_new = self._chunk_len(request.num_uncomputed_tokens, num_allowed, is_first_prefill)
                if num_new == 0 or not self._allocate_or_preempt(request, num_new, scheduled, preempted):
                    continue
            else:
                if preempted or len(self.running) >= self.config.max_num_seqs:
                    continue
                num_new = self._admit(request, budget, is_first_prefill)
                if num_new is None:
                    break  # out of blocks: later requests must not jump a stuck large one
                if num_new == 0:
                    continue
            scheduled[request.req_id] = num_new
            request.waiting_since_step = self.step_index
            budget -= num_new
            num_prompts_in_step += 1

    def _uncomputed_after_cached_prefix(self, request: Request) -> int:
        """Prompt tokens this request still has to compute, after the prefix cache's blocks for
        one waiting (as `_admit` would find them)."""
        if request.status is RequestStatus.RUNNING:
            return request.num_uncomputed_tokens
        if request.needs_prompt_logprobs:
            return request.num_tokens
        return request.num_tokens - len(self.kv_manager.find_cached_prefix(request)) * self.block_size

    def _chunk_len(self, num_remaining: int, budget: int, is_first_prefill: bool) -> int:
        if self.chunked_prefill.enable:
            return min(num_remaining, budget)
        # Without chunking a prompt runs whole; one larger than the budget runs alone.
        return num_remaining if num_remaining <= budget or is_first_prefill else 0

    def _admit(self, request: Request, budget: int, is_first_prefill: bool) -> int | None:
        """Move a waiting request to running with its cached prefix; the tokens it computes this
        step, 0 if it does not fit the budget, None if the KV cache is out of blocks."""
        # Prompt logprobs come from the prefill's rows: a cached position would have none.
        cached_prefix = [] if request.needs_prompt_logprobs else self.kv_manager.find_cached_prefix(request)
        num_cached_tokens = len(cached_prefix) * self.block_size
        num_new = self._chunk_len(request.num_tokens - num_cached_tokens, budget, is_first_prefill)
        if num_new == 0:
            return 0
        if not self.kv_manager.admit(request, cached_prefix, num_new):
            return None
        self.waiting.remove(request)
        self.running.append(request)
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_cached_tokens
        if request.timestamps.first_scheduled is None:
            request.num_cached_tokens = num_cached_tokens
            request.timestamps.first_scheduled = self.clock()
            if request.sampling_params.tracks_tokens:
                self._unsent_tracked[request.req_id] = TrackedRequest(
                    request.req_id,
                    request.sampling_params,
                    request.prompt_token_ids,
                    request.stop_token_ids,
                    request.bad_words_token_ids,
                    request.grammar,
                )
        return num_new

    def _allocate_or_preempt(
        self, request: Request, num_new: int, scheduled: dict[str, int], preempted: list[str]
    ) -> bool:
        """Room for `num_new` tokens, preempting the newest running requests if needed;
        False if `request` itself had to be preempted."""
        while not self.kv_manager.allocate_slots(request, num_new):
            victim = self.running[-1]
            self._preempt(victim)
            scheduled.pop(victim.req_id, None)
            preempted.append(victim.req_id)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.waiting.insert(0, request)
        self.stats.num_preemptions += 1
        logger.debug("preempted %s (%d tokens)", request.req_id, request.num_tokens)

    def _build_chunks(self, scheduled: dict[str, int]) -> list[ScheduledChunk]:
        chunks = []
        for req_id, num_new in scheduled.items():
            request = self.requests[req_id]
            start = request.num_computed_tokens
            end = start + num_new
            sample = None
            if end == request.num_tokens:
                sample = SampleSpec(request.sampling_params, request.num_output_tokens, req_id)
            is_decode = _is_decode(request, num_new)
            draft = self._drafts.get(req_id, [])
            chunks.append(
                ScheduledChunk(
                    req_id=req_id,
                    token_ids=request.token_ids[start:end] + draft,
                    start_position=start,
                    block_table=self.kv_manager.block_ids(req_id),
                    sample=sample,
                    prefill=not is_decode,
                    num_draft_tokens=len(draft),
                    prompt_logprobs=_prompt_logprob_spec(request, start, end),
                )
            )
            if draft:
                self.stats.num_drafts += 1
                self.stats.num_draft_tokens += len(draft)
            if is_decode:
                self.stats.num_decode_tokens += num_new
            else:
                self.stats.num_prefill_tokens += num_new
            request.num_computed_tokens = end
        self.stats.num_steps += 1
        return chunks

    # -- results ---------------------------------------------------------------------------

    def update(self, output: SchedulerOutput, model_output: ModelOutput) -> list[RequestProgress]:
        """Apply a step's sampled tokens: cache full blocks, check stop conditions, free the finished."""
        now = self.clock()
        progress = []
        for chunk in output.chunks:
            request = self.requests.get(chunk.req_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # aborted or preempted while the step ran
            self.kv_manager.register_computed_blocks(request)
            if request.timestamps.first_token is None:
                request.timestamps.prefill_chunk_ends.append(now)
            request.prompt_logprobs.extend(model_output.prompt_logprobs.get(chunk.req_id, ()))
            sampled = model_output.sampled.get(chunk.req_id)
            if sampled is None:
                continue
            if sampled.grammar_error is not None:
                constraint = request.sampling_params.structured_output
                field = constraint.field if constraint is not None else "structured_output"
                request.stop_reason = (
                    f"{field}: the output constraint failed mid-generation ({sampled.grammar_error})"
                )
                self.finish_request(request.req_id, RequestStatus.FINISHED_ERROR)
                progress.append(RequestProgress(request, []))
                continue
            tokens = self._accepted(chunk, [sampled, *model_output.verified.get(chunk.req_id, [])])
            appended = []
            for token in tokens:
                self._append_token(request, token.token_id, now)
                appended.append(token)
                status = self._stop_status(request, token.token_id)
                if status is not None:
                    self.finish_request(request.req_id, status)
                    break
            if request.status is RequestStatus.RUNNING and chunk.num_draft_tokens:
                # The accepted proposals' KV is the model's own: computed, and cacheable.
                request.num_computed_tokens += len(tokens) - 1
                self.kv_manager.register_computed_blocks(request)
                self.kv_manager.release_blocks_past(request, request.num_tokens)
            progress.append(RequestProgress(request, appended))
        return progress

    def _accepted(self, chunk: ScheduledChunk, sampled: list[SampledToken]) -> list[SampledToken]:
        """The model's tokens while it agrees with the proposals: its token after each accepted
        proposal, and after the last one (a correction, or one more)."""
        draft = chunk.token_ids[len(chunk.token_ids) - chunk.num_draft_tokens :]
        num_accepted = 0
        while num_accepted < len(draft) and sampled[num_accepted].token_id == draft[num_accepted]:
            num_accepted += 1
        if draft:
            self.stats.num_accepted_tokens += num_accepted
            positions = self.stats.accepted_per_position
            positions.extend([0] * (len(draft) - len(positions)))
            for position in range(num_accepted):
                positions[position] += 1
        return sampled[: num_accepted + 1]

    def _append_token(self, request: Request, token_id: int, now: float) -> None:
        request.append_output_token(token_id)
        extend_block_hashes(request.block_hashes, request.token_ids, self.block_size, self.hash_root)
        if request.timestamps.first_token is None:
            request.timestamps.first_token = now
        request.timestamps.last_token = now

    @staticmethod
    def _stop_status(request: Request, token_id: int) -> RequestStatus | None:
        params = request.sampling_params
        if not params.ignore_eos and token_id in request.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if token_id in params.stop_token_ids:
            request.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= params.max_tokens or request.num_tokens >= request.max_total_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    # -- observability ---------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)


def _is_decode(request: Request, num_new: int) -> bool:
    """A one-token chunk right after a generated token (not a prompt chunk or a recompute)."""
    return (
        num_new == 1
        and request.num_output_tokens > 0
        and request.num_computed_tokens == request.num_tokens - 1
    )


def _prompt_logprob_spec(request: Request, start: int, end: int) -> PromptLogprobSpec | None:
    """The rows of the chunk [start, end) that score prompt tokens not scored yet (a recompute
    after preemption skips those scored before it); None when there are none."""
    if not request.needs_prompt_logprobs:
        return None
    first = max(start, len(request.prompt_logprobs))
    # The last prompt row predicts the first output token, not a prompt token.
    last = min(end, request.num_prompt_tokens - 1)
    if first >= last:
        return None
    num_top = request.sampling_params.prompt_logprobs
    assert num_top is not None  # needs_prompt_logprobs
    return PromptLogprobSpec(first, request.prompt_token_ids[first + 1 : last + 1], num_top)
