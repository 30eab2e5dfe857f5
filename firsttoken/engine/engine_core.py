"""EngineCore: wires the scheduler, the worker and the output processor, and runs the step loop.

step(): scheduler.schedule() -> executor.execute() -> scheduler.update() -> text deltas, then
the proposer drafts tokens for the next step to verify. No tensor lives here: the workers own
the device, the model and the KV tensors; this class owns the requests, the block bookkeeping
and the pinned prefixes. It is single-threaded by design; front ends (LLM, AsyncEngine) own the
thread it runs on.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections.abc import Iterator, Sequence
from typing import Any, Callable

from firsttoken.config import EngineConfig
from firsttoken.core.batch import ModelOutput, SchedulerOutput
from firsttoken.core.cost_model import StepTimeTracker
from firsttoken.core.hashing import BlockHash, root_hash
from firsttoken.core.kv_cache_manager import KVCacheManager
from firsttoken.core.scheduler import Scheduler
from firsttoken.engine.output_processor import OutputProcessor
from firsttoken.engine.pinned_prefixes import PinnedPrefixes
from firsttoken.errors import InvalidInputError
from firsttoken.outputs import EngineCompute, EngineInspection, EngineStats, PinnedPrefix, RequestDelta
from firsttoken.request import Request, RequestStatus, RequestTimestamps
from firsttoken.sample.grammar import CompiledGrammar, GrammarCompiler
from firsttoken.sampling_params import SamplingParams, StructuredOutput
from firsttoken.speculative.proposer import DraftProposer
from firsttoken.stage_observer import DETOKENIZE, StageObserver, observed
from firsttoken.worker.checkpoint_quantization import resolve_checkpoint_quantization
from firsttoken.worker.executor import Executor

logger = logging.getLogger(__name__)


def _log_refusals_without_objective(config: EngineConfig) -> None:
    """`refuse` without an engine objective is allowed (a request's own ttft_slo_ms is predicted
    and may be refused), but refuses nothing else: say so, as a forgotten --ttft-slo-ms looks
    the same."""
    if config.scheduler.slo_policy == "refuse" and config.scheduler.ttft_slo_ms is None:
        logger.warning(
            "slo_policy 'refuse' without ttft_slo_ms: only requests that carry their own ttft_slo_ms "
            "can be refused; the others hold no objective to miss"
        )


class EngineCore:
    """Owns the executor (and through it the workers), the KV block manager, the scheduler, the
    output processor, the grammar compiler, the pinned prefixes and the proposer of draft tokens
    of one engine."""

    def __init__(self, config: EngineConfig, proposer: DraftProposer | None = None) -> None:
        """`proposer`: drafts tokens for speculative decoding (engine/builder.py makes it)."""
        # Resolved once, before any rank exists: the ranks, the scheduler and inspect() then read
        # the quantization the checkpoint runs under from one config.
        self.config = config = resolve_checkpoint_quantization(config)
        self.executor = Executor(config)
        # This process's worker (the driver's): the vocabulary, the KV blocks' count, pinned KV.
        self.worker = self.executor.worker
        self.model_path = self.worker.model_path
        self.tokenizer = self.worker.tokenizer
        self.max_model_len = self.worker.max_model_len
        block_size = config.cache.block_size
        # Warm-up and calibration run on scratch blocks, before any request can hold one.
        self.executor.warm_up()
        # TTFT objectives are predicted on the same cost model as auto's chunks.
        predicts_ttft = config.predicts_ttft
        needs_cost = predicts_ttft or self.worker.adapts_threads
        step_cost = self.executor.step_cost_model() if needs_cost else None
        step_times = StepTimeTracker(step_cost) if predicts_ttft else None
        _log_refusals_without_objective(config)
        self.kv_manager = KVCacheManager(
            self.worker.num_kv_blocks,
            block_size,
            config.prompt_cache.enable,
            sliding_window=self.worker.model.kv_window,
            sink_tokens=self.worker.model.kv_sink_tokens,
        )
        self.hash_root = root_hash(self.worker.kv_identity)
        self.scheduler = Scheduler(
            config.scheduler,
            config.chunked_prefill,
            self.kv_manager,
            self.max_model_len,
            self.hash_root,
            step_times,
            max_num_speculating_seqs=config.speculative_config.max_num_speculating_seqs,
        )
        self.proposer = proposer
        self.output_processor = OutputProcessor(self.tokenizer)
        self.stage_observer: StageObserver | None = None  # set by observing_stages
        # Called between a step's schedule and its execution (the front end's step loop
        # publishes its stats then, so that its gauges show a long step's work while it runs).
        self.on_scheduled: Callable[[], None] | None = None
        self.grammar_compiler = GrammarCompiler(self.tokenizer, self.worker.vocab_size)
        self._request_counter = itertools.count()
        self.pinned_prefixes = PinnedPrefixes(
            self.kv_manager,
            self.worker,
            self.hash_root,
            config.prompt_cache.enable,
            config.prompt_cache.max_pinned_fraction,
            self.max_model_len,
        )
        self.pinned_prefixes.restore_stored()
        logger.info(
            "engine ready: %s, %d KV blocks of %d tokens, max_model_len %d",
            self.worker.describe(),
            self.kv_manager.num_blocks,
            block_size,
            self.max_model_len,
        )
        self.compute = EngineCompute(
            dtype=str(self.worker.dtype).removeprefix("torch."),
            batch_invariant=self.worker.batch_invariant,
            start_up_choices=(*self.worker.describe_choices(), self.scheduler.describe_chunking()),
        )
        for choice in self.compute.start_up_choices:
            logger.info("%s", choice)

    @property
    def max_request_tokens(self) -> int:
        """The longest request (prompt + output) the KV cache can hold at all."""
        return min(self.max_model_len, self.kv_manager.num_blocks * self.config.cache.block_size)

    # -- requests ------------------------------------------------------------------------

    def new_req_id(self) -> str:
        return f"req-{next(self._request_counter)}"

    def add_request(
        self,
        req_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        arrival_time: float | None = None,
        tokenized_time: float | None = None,
        priority: int = 0,
        ttft_slo_ms: float | None = None,
        grammar: CompiledGrammar | None = None,
    ) -> Request:
        """Queue a request; raises InvalidInputError or QueueFullError (SloUnattainableError
        when refused as predicted to miss its TTFT objective), changing nothing.
        `ttft_slo_ms`: its TTFT objective (default: the engine's scheduler.ttft_slo_ms).
        `grammar`: its structured output's grammar where a front end compiled it already
        (`compile_grammar`); compiled here otherwise."""
        if ttft_slo_ms is not None and not ttft_slo_ms > 0:
            raise InvalidInputError("ttft_slo_ms", f"must be > 0, got {ttft_slo_ms}")
        self.validate_request(prompt_token_ids, sampling_params)
        structured = sampling_params.structured_output
        if structured is not None and grammar is None:
            grammar = self.grammar_compiler.compile(structured)
        now = time.perf_counter()
        arrival = arrival_time if arrival_time is not None else now
        request = Request(
            req_id=req_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=sampling_params,
            eos_token_ids=self.tokenizer.eos_token_ids,
            max_total_tokens=len(prompt_token_ids) + sampling_params.max_tokens,
            timestamps=RequestTimestamps(
                arrival=arrival, tokenized=tokenized_time if tokenized_time is not None else arrival
            ),
            priority=priority,
            ttft_slo_s=None if ttft_slo_ms is None else ttft_slo_ms / 1000,
            bad_words_token_ids=self.tokenizer.encode_bad_words(sampling_params.bad_words),
            grammar=grammar,
        )
        self.scheduler.add_request(request)
        self.output_processor.add_request(request)
        return request

    def validate_request(self, prompt_token_ids: list[int], sampling_params: SamplingParams) -> None:
        """Raise InvalidInputError for a request no load could ever run. It reads only what never
        changes after start-up (the vocabulary, max_model_len, the cache's size), so a front end
        may call it from any thread, and refuse a request without waiting for a step to end."""
        self._validate_prompt_tokens(prompt_token_ids)
        self._validate_sampling_token_ids(sampling_params)
        self.scheduler.validate_capacity(len(prompt_token_ids), sampling_params.max_tokens)

    def _validate_prompt_tokens(self, prompt_token_ids: list[int]) -> None:
        if not prompt_token_ids:
            raise InvalidInputError("prompt", "must not be empty")
        vocab_size = self.worker.vocab_size
        for token_id in prompt_token_ids:
            if not isinstance(token_id, int) or isinstance(token_id, bool) or not 0 <= token_id < vocab_size:
                raise InvalidInputError(
                    "prompt_token_ids", f"{token_id!r} is not a token id in [0, {vocab_size})"
                )

    def _validate_sampling_token_ids(self, params: SamplingParams) -> None:
        vocab_size = self.worker.vocab_size
        fields = (("logit_bias", params.logit_bias or {}), ("stop_token_ids", params.stop_token_ids))
        for field, token_ids in fields:
            for token_id in token_ids:
                if token_id >= vocab_size:
                    raise InvalidInputError(
                        field, f"{token_id} is not a token id: the vocabulary has {vocab_size} tokens"
                    )

    def compile_grammar(self, structured: StructuredOutput) -> CompiledGrammar:
        """Compile a constraint ahead of add_request, from any thread (add_request then takes
        it); raises InvalidInputError naming its field when it is not valid."""
        return self.grammar_compiler.compile(structured)

    def abort_request(self, req_id: str) -> RequestDelta | None:
        """End a request now; its KV blocks are freed before this returns."""
        self.pinned_prefixes.abandon(req_id)
        request = self.scheduler.finish_request(req_id, RequestStatus.FINISHED_ABORTED)
        if request is None:
            return None
        self._release_finished()
        return self.output_processor.closing_delta(request)

    def _release_finished(self) -> None:
        """Free the worker's token state of the tracked requests that ended."""
        finished = self.scheduler.take_finished_tracked()
        if finished:
            self.worker.release_requests(finished)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # -- the step ------------------------------------------------------------------------

    def step(self) -> list[RequestDelta]:
        """schedule -> execute -> update -> propose (the next step's drafts), each phase timed."""
        expired_requests = self.scheduler.expire_waiting(self.pinned_prefixes.computing_req_ids)
        expired = [self.output_processor.closing_delta(request) for request in expired_requests]
        if expired:
            self._release_finished()
        started = time.perf_counter()
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            return expired
        if self.on_scheduled is not None:
            self.on_scheduled()
        scheduled = time.perf_counter()
        model_output = self.executor.execute(scheduler_output)
        executed = time.perf_counter()
        deltas = self._update(scheduler_output, model_output)
        updated = time.perf_counter()
        self._propose_drafts()
        proposed = time.perf_counter()
        # The decodes wait for the proposal as they wait for the forward pass: the cost model
        # behind chunk_size="auto" sees both.
        self.scheduler.observe_step_time(scheduler_output, (executed - scheduled) + (proposed - updated))
        logger.debug(
            "step %d (%d tokens in %d chunks): schedule %.3f ms, execute %.3f ms, update %.3f ms, "
            "propose %.3f ms",
            self.scheduler.step_index,
            scheduler_output.num_tokens,
            len(scheduler_output.chunks),
            (scheduled - started) * 1e3,
            (executed - scheduled) * 1e3,
            (updated - executed) * 1e3,
            (proposed - updated) * 1e3,
        )
        return expired + deltas

    def _update(self, scheduler_output: SchedulerOutput, model_output: ModelOutput) -> list[RequestDelta]:
        """Apply a step's tokens to its requests; the text deltas of the front ends' requests."""
        deltas = []
        for progress in self.scheduler.update(scheduler_output, model_output):
            if progress.request.req_id in self.pinned_prefixes.computing_req_ids:
                self.pinned_prefixes.complete(progress.request)
                continue
            with observed(self.stage_observer, DETOKENIZE):
                stop_string = self.output_processor.detokenize(progress)
            if stop_string is not None:
                self._finish_at_stop_string(progress.request, stop_string)
            deltas.append(self.output_processor.delta(progress))
        self._release_finished()
        return deltas

    def _propose_drafts(self) -> None:
        """Ask the proposer for the next step's drafts; the scheduler verifies them then."""
        if self.proposer is None:
            return
        slots = self.scheduler.draft_slots()
        if not slots:
            return
        proposals = self.proposer.propose_batch(
            [slot.request.token_ids for slot in slots], [slot.max_tokens for slot in slots]
        )
        for slot, proposal in zip(slots, proposals):
            slot.request.draft_token_ids = proposal

    def _finish_at_stop_string(self, request: Request, stop_string: str) -> None:
        request.stop_reason = stop_string
        if request.is_finished:
            # Its last allowed token completed the stop string: the text ends at the string, so
            # the string is why it ended (OpenAI's and vLLM's "stop", not "length").
            request.status = RequestStatus.FINISHED_STOPPED
        else:
            self.scheduler.finish_request(request.req_id, RequestStatus.FINISHED_STOPPED)

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks; the engine cannot step afterwards."""
        self.executor.shutdown()

    # -- pinned prefixes -----------------------------------------------------------------

    def pin_prefix(self, token_ids: list[int], pin_id: str) -> str:
        """Queue the computation of a prefix whose full blocks will then stay resident until
        unpinned; returns the internal request id. The pin exists once it is in
        `pinned_prefixes.resident`."""
        self.pinned_prefixes.check_can_pin(pin_id, token_ids)
        req_id = f"pin:{pin_id}"
        self.add_request(
            req_id, list(token_ids), SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        )
        self.output_processor.remove(req_id)
        self.pinned_prefixes.start(pin_id, req_id, len(token_ids))
        return req_id

    def pin_prefix_now(self, token_ids: list[int], pin_id: str) -> PinnedPrefix:
        """Pin a prefix, stepping until it is resident (for a caller that owns the step loop and
        runs no request meanwhile); an existing pin of other tokens under `pin_id` is replaced."""
        pins = self.pinned_prefixes
        existing = pins.resident_pin(pin_id, token_ids)
        if existing is not None:
            return existing  # already resident, e.g. restored from the persist folder
        if pin_id in pins.resident:
            pins.unpin(pin_id)
        req_id = self.pin_prefix(token_ids, pin_id)
        try:
            while pin_id not in pins.resident:
                self.step()
        finally:
            if pin_id not in pins.resident:
                self.abort_request(req_id)
        return pins.resident[pin_id]

    def cached_block_hashes(self, block_hashes: Sequence[BlockHash]) -> list[BlockHash]:
        """Those of `block_hashes` whose blocks the prefix cache holds now."""
        pool = self.kv_manager.pool
        return [block_hash for block_hash in block_hashes if pool.cached_block(block_hash) is not None]

    def reset_prefix_cache(self) -> None:
        """Forget every cached and pinned prefix (persisted pins stay on disk)."""
        self.kv_manager.reset_prefix_cache()
        self.pinned_prefixes.forget_resident()

    # -- observability -------------------------------------------------------------------

    def inspect(self) -> EngineInspection:
        """What this engine was built with: model, kernels, KV cache, the start-up choices."""
        worker = self.worker
        arch = worker.checkpoint.arch
        return EngineInspection(
            model_path=str(self.model_path),
            architecture=arch.architecture,
            num_layers=arch.num_layers,
            vocab_size=worker.vocab_size,
            max_model_len=self.max_model_len,
            device=str(worker.device),
            dtype=self.compute.dtype,
            batch_invariant=self.compute.batch_invariant,
            quantization=self.config.model_config.quantization,
            checkpoint_quantization=worker.checkpoint.quantization,
            native_isa=worker.native_isa,
            whole_step_forwards=worker.whole_step_forwards,
            whole_step_unsupported_reason=worker.runner.whole_step_unsupported_reason,
            num_threads=worker.num_threads,
            tensor_parallel_size=worker.tensor_parallel_size,
            num_kv_blocks=self.kv_manager.num_blocks,
            block_size=self.config.cache.block_size,
            kv_identity=worker.kv_identity,
            graph_capture=worker.graph_capture,
            description=worker.describe(),
            start_up_choices=self.compute.start_up_choices,
        )

    def single_rank_model(self) -> Any:
        """The model's modules, for tools that calibrate or turn its weights in place (quantize,
        rotation); refused under tensor parallelism, where this process holds one shard."""
        if self.worker.tensor_parallel_size > 1:
            raise InvalidInputError(
                "tensor_parallel_size", "must be 1 to reach the model's modules: each rank holds a shard"
            )
        return self.worker.model

    @contextlib.contextmanager
    def observing_stages(self, observer: StageObserver) -> Iterator[Any]:
        """Reports the LM head's, sampling's and detokenizing's boundaries to `observer` while
        inside; yields the model, whose layers a profiler hooks. Refused under tensor
        parallelism (see single_rank_model)."""
        model = self.single_rank_model()
        runner = self.worker.runner
        runner.stage_observer = self.stage_observer = observer
        try:
            yield model
        finally:
            runner.stage_observer = self.stage_observer = None

    @contextlib.contextmanager
    def forward_op_by_op(self) -> Iterator[tuple[str, ...]]:
        """Steps on the model's forward, op by op, while inside; yields the whole-step forwards
        set aside (see Worker.forward_op_by_op)."""
        with self.worker.forward_op_by_op() as set_aside:
            yield set_aside


    def stats(self) -> EngineStats:
        scheduler_stats = self.scheduler.stats
        prefix_stats = self.kv_manager.stats
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=self.kv_manager.usage,
            num_kv_blocks=self.kv_manager.num_blocks,
            num_free_kv_blocks=self.kv_manager.pool.num_free_blocks,
            prefix_cache_queries=prefix_stats.num_query_tokens,
            prefix_cache_hits=prefix_stats.num_hit_tokens,
            num_preemptions=scheduler_stats.num_preemptions,
            num_prefill_tokens=scheduler_stats.num_prefill_tokens,
            num_decode_tokens=scheduler_stats.num_decode_tokens,
            num_steps=scheduler_stats.num_steps,
            last_prefill_budget=scheduler_stats.last_prefill_budget,
            num_pinned_tokens=self.pinned_prefixes.num_pinned_tokens,
            num_slo_refusals=scheduler_stats.num_slo_refusals,
            num_deferred_decodes=scheduler_stats.num_deferred_decodes,
            spec_decode_num_drafts=scheduler_stats.num_drafts,
            spec_decode_num_draft_tokens=scheduler_stats.num_draft_tokens,
            spec_decode_num_accepted_tokens=scheduler_stats.num_accepted_tokens,
            spec_decode_accepted_per_position=tuple(scheduler_stats.accepted_per_position),
        )

