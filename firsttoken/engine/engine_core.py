"""EngineCore: wires the scheduler, the worker and the output processor, and runs the step loop.

step(): scheduler.schedule() -> executor.execute() -> scheduler.update() -> text deltas.
No tensor lives here: the worker owns the device, the model and the KV tensors; this class
owns the requests, the block bookkeeping and the pinned prefixes. It is single-threaded by
design; front ends (LLM, AsyncEngine) own the thread it runs on.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence

from firsttoken.config import EngineConfig
from firsttoken.core.cost_model import StepTimeTracker
from firsttoken.core.hashing import BlockHash, extend_block_hashes, root_hash
from firsttoken.core.kv_cache_manager import KVCacheManager
from firsttoken.core.scheduler import DraftProposer, Scheduler
from firsttoken.engine.draft_model import DraftModelProposer
from firsttoken.engine.output_processor import OutputProcessor
from firsttoken.errors import InvalidInputError
from firsttoken.outputs import EngineStats, PinnedPrefix, RequestDelta
from firsttoken.request import Request, RequestStatus, RequestTimestamps
from firsttoken.sample.grammar import GrammarCompiler
from firsttoken.sampling_params import SamplingParams, StructuredOutput
from firsttoken.spec.ngram import NgramProposer
from firsttoken.worker.executor import Executor
from firsttoken.worker.pinned_prefix_store import validate_pin_id

logger = logging.getLogger(__name__)


class EngineCore:
    """Owns the executor (and through it the workers), the KV block manager, the scheduler, the
    output processor and the grammar compiler of one engine, and the pinned prefixes."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.executor = Executor(config)
        # This process's worker (the driver's): the vocabulary, the KV blocks' count, pinned KV.
        self.worker = self.executor.worker
        self.model_path = self.worker.model_path
        self.tokenizer = self.worker.tokenizer
        self.max_model_len = self.worker.max_model_len
        block_size = config.cache.block_size
        # Warm-up and calibration run on scratch blocks, before any request can hold one.
        self.executor.warm_up()
        auto_chunks = config.chunked_prefill.enable and config.chunked_prefill.chunk_size == "auto"
        step_cost = self.executor.step_cost_model() if auto_chunks or self.worker.adapts_threads else None
        step_times = StepTimeTracker(step_cost) if auto_chunks else None
        self.kv_manager = KVCacheManager(self.worker.num_kv_blocks, block_size, config.prompt_cache.enable)
        self.hash_root = root_hash(self.worker.kv_identity)
        self.scheduler = Scheduler(
            config.scheduler,
            config.chunked_prefill,
            self.kv_manager,
            self.max_model_len,
            self.hash_root,
            step_times,
            proposer=draft_proposer(config, self.worker.vocab_size),
            max_num_speculating_seqs=config.speculative_config.max_num_speculating_seqs,
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self.grammar_compiler = GrammarCompiler(self.tokenizer, self.worker.vocab_size)
        self._request_counter = itertools.count()
        self.pinned: dict[str, PinnedPrefix] = {}
        self._pending_pins: dict[str, str] = {}  # internal request id -> pin id
        self._restore_pinned_prefixes()
        logger.info(
            "engine ready: %s, %d KV blocks of %d tokens, max_model_len %d",
            self.worker.describe(),
            self.kv_manager.num_blocks,
            block_size,
            self.max_model_len,
        )

    @property
    def max_request_tokens(self) -> int:
        """The longest request (prompt + output) the KV cache can hold at all."""
        return min(self.max_model_len, self.kv_manager.num_blocks * self.config.cache.block_size)

    # -- requests ------------------------------------------------------------------------

    def new_request_id(self) -> str:
        return f"req-{next(self._request_counter)}"

    def add_request(
        self,
        req_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        arrival_time: float | None = None,
        tokenized_time: float | None = None,
        priority: int = 0,
    ) -> Request:
        """Queue a request; raises InvalidInputError or QueueFullError, changing nothing."""
        self.validate_request(prompt_token_ids, sampling_params)
        structured = sampling_params.structured_output
        # A cache hit when the front end compiled it on arrival (AsyncEngine.add_request).
        grammar = None if structured is None else self.grammar_compiler.compile(structured)
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

    def compile_grammar(self, structured: StructuredOutput) -> None:
        """Compile a constraint ahead of add_request, from any thread (add_request then finds it
        cached); raises InvalidInputError naming its field when it is not valid."""
        self.grammar_compiler.compile(structured)

    def abort_request(self, req_id: str) -> RequestDelta | None:
        """End a request now; its KV blocks are freed before this returns."""
        self._pending_pins.pop(req_id, None)
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
        expired_requests = self.scheduler.expire_waiting(self._pending_pins)
        expired = [self.output_processor.closing_delta(request) for request in expired_requests]
        if expired:
            self._release_finished()
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            return expired
        started = time.perf_counter()
        model_output = self.executor.execute(scheduler_output)
        self.scheduler.observe_step_time(scheduler_output, time.perf_counter() - started)
        deltas = []
        for progress in self.scheduler.update(scheduler_output, model_output):
            if progress.request.req_id in self._pending_pins:
                self._complete_pin(progress.request)
                continue
            stop_string = self.output_processor.detokenize(progress)
            if stop_string is not None:
                self._finish_at_stop_string(progress.request, stop_string)
            deltas.append(self.output_processor.delta(progress))
        self._release_finished()
        return expired + deltas

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
        unpinned; returns the internal request id. The pin exists once `pin_id in self.pinned`."""
        if not self.config.prompt_cache.enable:
            raise InvalidInputError("pin_prefix", "the prompt cache is disabled (enable_prompt_cache=False)")
        validate_pin_id(pin_id)
        block_size = self.config.cache.block_size
        if len(token_ids) < block_size:
            raise InvalidInputError(
                "prefix",
                f"{len(token_ids)} tokens is shorter than one KV block ({block_size} tokens); nothing to pin",
            )
        if pin_id in self.pinned or pin_id in self._pending_pins.values():
            raise InvalidInputError("pin_id", f"{pin_id!r} is already pinned")
        self._check_pinned_blocks_limit(len(token_ids) // block_size)
        req_id = f"pin:{pin_id}"
        self.add_request(
            req_id, list(token_ids), SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        )
        self.output_processor.remove(req_id)
        self._pending_pins[req_id] = pin_id
        return req_id

    def _check_pinned_blocks_limit(self, num_new_blocks: int) -> None:
        """Pins never give up their blocks, so together they may hold only a share of the cache:
        the rest serves requests."""
        block_size = self.config.cache.block_size
        num_pinned = sum(len(pinned.token_ids) // block_size for pinned in self.pinned.values())
        num_pinned += sum(
            self.scheduler.requests[req_id].num_prompt_tokens // block_size for req_id in self._pending_pins
        )
        fraction = self.config.prompt_cache.max_pinned_fraction
        limit = int(fraction * self.kv_manager.num_blocks)
        if num_pinned + num_new_blocks > limit:
            raise InvalidInputError(
                "prefix",
                f"pinning {num_new_blocks} more KV blocks would make {num_pinned + num_new_blocks} pinned, "
                f"over the limit of {limit} ({fraction:g} of {self.kv_manager.num_blocks}: "
                "max_pinned_fraction); unpin a prefix first",
            )

    def resident_pin(self, pin_id: str, token_ids: list[int]) -> PinnedPrefix | None:
        """The pin `pin_id` if it already holds the full blocks of `token_ids`, else None."""
        existing = self.pinned.get(pin_id)
        block_size = self.config.cache.block_size
        num_full = len(token_ids) // block_size * block_size
        if existing is None or existing.token_ids != token_ids[:num_full]:
            return None
        return existing

    def unpin_prefix(self, pin_id: str) -> None:
        if pin_id not in self.pinned:
            raise InvalidInputError("pin_id", f"no pinned prefix {pin_id!r}")
        self.kv_manager.unpin(pin_id)
        del self.pinned[pin_id]
        self.worker.delete_prefix(pin_id)

    def cached_block_hashes(self, block_hashes: Sequence[BlockHash]) -> list[BlockHash]:
        """Those of `block_hashes` whose blocks the prefix cache holds now."""
        pool = self.kv_manager.pool
        return [block_hash for block_hash in block_hashes if pool.cached_block(block_hash) is not None]

    def reset_prefix_cache(self) -> None:
        """Forget every cached and pinned prefix (persisted pins stay on disk)."""
        self.kv_manager.reset_prefix_cache()
        self.pinned.clear()

    def _complete_pin(self, request: Request) -> None:
        pin_id = self._pending_pins.pop(request.req_id)
        num_blocks = request.num_prompt_tokens // self.config.cache.block_size
        num_tokens = self.kv_manager.pin(pin_id, request.block_hashes[:num_blocks])
        self.pinned[pin_id] = PinnedPrefix(pin_id, request.prompt_token_ids[:num_tokens])
        self.worker.save_prefix(
            pin_id,
            self.pinned[pin_id].token_ids,
            self.kv_manager.pinned_block_hashes(pin_id),
            self.kv_manager.pinned_block_ids(pin_id),
        )

    def _restore_pinned_prefixes(self) -> None:
        block_size = self.config.cache.block_size
        for stored in self.worker.stored_prefixes():
            token_ids = stored.token_ids[: len(stored.block_hashes) * block_size]
            expected_hashes: list[bytes] = []
            extend_block_hashes(expected_hashes, token_ids, block_size, self.hash_root)
            if expected_hashes != stored.block_hashes or stored.pin_id in self.pinned:
                logger.warning(
                    "prompt cache: refusing %s: its hashes do not match this engine", stored.pin_id
                )
                continue
            block_ids = self.kv_manager.adopt_pinned_blocks(stored.pin_id, stored.block_hashes)
            if block_ids is None:
                logger.warning("prompt cache: no room to restore %s", stored.pin_id)
                continue
            self.worker.restore_prefix(stored, block_ids)
            self.pinned[stored.pin_id] = PinnedPrefix(stored.pin_id, token_ids)
            logger.info("prompt cache: restored %s (%d tokens)", stored.pin_id, len(token_ids))

    # -- observability -------------------------------------------------------------------

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
            num_pinned_tokens=sum(prefix.num_tokens for prefix in self.pinned.values()),
            spec_decode_num_drafts=scheduler_stats.num_drafts,
            spec_decode_num_draft_tokens=scheduler_stats.num_draft_tokens,
            spec_decode_num_accepted_tokens=scheduler_stats.num_accepted_tokens,
            spec_decode_accepted_per_position=tuple(scheduler_stats.accepted_per_position),
        )


def draft_proposer(config: EngineConfig, vocab_size: int) -> DraftProposer | None:
    speculative = config.speculative_config
    if speculative.method == "ngram":
        return NgramProposer(speculative.num_speculative_tokens, speculative.prompt_lookup_max,
                             speculative.prompt_lookup_min)
    if speculative.method == "draft":
        return DraftModelProposer(config, speculative, vocab_size)
    return None
