"""EngineCore: builds every part from an EngineConfig and runs the step loop.

step(): scheduler.schedule() -> runner.execute() -> scheduler.update() -> text deltas.
It is single-threaded by design; front ends (LLM, AsyncEngine) own the thread it runs on.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

import torch

from firsttoken.attention.sdpa import SDPABackend
from firsttoken.config import EngineConfig
from firsttoken.core.batch import SampleSpec, ScheduledChunk, SchedulerOutput
from firsttoken.core.hashing import root_hash
from firsttoken.core.kv_cache_manager import KVCacheManager
from firsttoken.core.scheduler import Scheduler
from firsttoken.engine.output_processor import OutputProcessor
from firsttoken.models.registry import build_model, open_checkpoint, resolve_model_path
from firsttoken.outputs import RequestDelta
from firsttoken.request import Request, RequestStatus, RequestTimestamps
from firsttoken.sample.sampler import Sampler
from firsttoken.sampling_params import SamplingParams
from firsttoken.worker.device import physical_core_count, resolve_device, resolve_dtype
from firsttoken.worker.kv_cache import allocate_kv_caches, num_kv_blocks
from firsttoken.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's gauges and counters."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_kv_blocks: int
    num_free_kv_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_steps: int
    last_prefill_budget: int


class EngineCore:
    """Owns the model, KV cache, scheduler, runner and output processor of one engine."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        model_config = config.model_config
        self.device = resolve_device(model_config.device)
        self.dtype = resolve_dtype(model_config.dtype, self.device)
        if self.device.type == "cpu":
            torch.set_num_threads(model_config.num_threads or physical_core_count())
        self.model_path = resolve_model_path(model_config.model)
        self.checkpoint = open_checkpoint(self.model_path)
        self.tokenizer = self.checkpoint.tokenizer
        arch = self.checkpoint.arch
        self.max_model_len = self._max_model_len()
        backend = SDPABackend(self.device)
        self.model = build_model(
            self.checkpoint, backend, self.dtype, self.device, self.max_model_len, cache_dir=None
        )
        block_size = config.cache.block_size
        num_blocks = num_kv_blocks(config.cache, arch, self.dtype, self.device)
        self.kv_caches = allocate_kv_caches(arch, num_blocks, block_size, self.dtype, self.device)
        self.model.bind_kv_caches(self.kv_caches)
        self.kv_manager = KVCacheManager(num_blocks, block_size, config.prompt_cache.enable)
        self.scheduler = Scheduler(
            config.scheduler,
            config.chunked_prefill,
            self.kv_manager,
            self.max_model_len,
            root_hash(f"{self.checkpoint.fingerprint}|{self.dtype}|{block_size}"),
        )
        self.runner = ModelRunner(self.model, backend, Sampler(model_config.seed, self.device), block_size, self.device)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._request_counter = itertools.count()
        self._warm_up()
        logger.info(
            "engine ready: %s (%s, %s on %s), %d KV blocks of %d tokens, max_model_len %d",
            self.model_path, arch.architecture, self.dtype, self.device, num_blocks, block_size, self.max_model_len,
        )

    def _max_model_len(self) -> int:
        arch = self.checkpoint.arch
        limit = arch.max_position_embeddings
        if arch.sliding_window:
            limit = min(limit, arch.sliding_window)  # full attention is exact up to the window
        requested = self.config.model_config.max_model_len
        if requested is not None and requested > limit:
            raise ValueError(f"max_model_len: {requested} exceeds the model's limit of {limit} tokens")
        return requested or limit

    def _warm_up(self) -> None:
        """Run one prefill and one decode on a free block, so the first request pays no
        one-time kernel initialisation. No request, hash or counter is touched."""
        block_size = self.config.cache.block_size
        num_tokens = min(block_size, self.max_model_len - 1) or 1
        params = SamplingParams(temperature=0, max_tokens=1)
        for start, count in ((0, num_tokens), (num_tokens, 1)):
            if start + count > min(block_size * self.kv_manager.num_blocks, self.max_model_len):
                continue
            chunk = ScheduledChunk(
                req_id="warm-up",
                token_ids=[0] * count,
                start_position=start,
                block_table=list(range(-(-(start + count) // block_size))),
                sample=SampleSpec(params, 0),
            )
            self.runner.execute(SchedulerOutput(chunks=[chunk], token_budget=count))

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
        """Queue a request; raises ValueError (bad input) or QueueFullError, changing nothing."""
        self._validate_prompt_tokens(prompt_token_ids)
        now = time.perf_counter()
        arrival = arrival_time if arrival_time is not None else now
        request = Request(
            req_id=req_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=sampling_params,
            eos_token_ids=self.tokenizer.eos_token_ids,
            max_total_tokens=len(prompt_token_ids) + sampling_params.max_tokens,
            timestamps=RequestTimestamps(arrival=arrival, tokenized=tokenized_time if tokenized_time is not None else arrival),
            priority=priority,
        )
        self.scheduler.add_request(request)
        self.output_processor.add_request(request)
        return request

    def _validate_prompt_tokens(self, prompt_token_ids: list[int]) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt: must not be empty")
        vocab_size = self.checkpoint.arch.vocab_size
        for token_id in prompt_token_ids:
            if not isinstance(token_id, int) or isinstance(token_id, bool) or not 0 <= token_id < vocab_size:
                raise ValueError(f"prompt_token_ids: {token_id!r} is not a token id in [0, {vocab_size})")

    def validate_request_size(self, num_prompt_tokens: int, max_tokens: int) -> None:
        self.scheduler.validate_capacity(num_prompt_tokens, max_tokens)

    def abort_request(self, req_id: str) -> RequestDelta | None:
        """End a request now; its KV blocks are freed before this returns."""
        request = self.scheduler.finish_request(req_id, RequestStatus.FINISHED_ABORTED)
        if request is None:
            return None
        return self.output_processor.closing_delta(request)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # -- the step ------------------------------------------------------------------------

    def step(self) -> list[RequestDelta]:
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            return []
        model_output = self.runner.execute(scheduler_output)
        deltas = []
        for progress in self.scheduler.update(scheduler_output, model_output):
            stop_string = self.output_processor.detokenize(progress)
            if stop_string is not None:
                progress.request.stop_reason = stop_string
                self.scheduler.finish_request(progress.request.req_id, RequestStatus.FINISHED_STOPPED)
            deltas.append(self.output_processor.delta(progress))
        return deltas

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
        )

