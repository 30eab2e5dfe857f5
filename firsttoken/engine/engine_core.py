"""EngineCore: builds every part from an EngineConfig and runs the step loop.

step(): scheduler.schedule() -> runner.execute() -> scheduler.update() -> text deltas.
It is single-threaded by design; front ends (LLM, AsyncEngine) own the thread it runs on.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from typing import TYPE_CHECKING

import torch

from firsttoken.attention.backend import AttentionBackend
from firsttoken.attention.selector import select_attention_backend
from firsttoken.config import EngineConfig
from firsttoken.core.batch import SampleSpec, ScheduledChunk, SchedulerOutput
from firsttoken.core.cost_model import StepCostModel, StepTimeTracker
from firsttoken.core.hashing import extend_block_hashes, root_hash
from firsttoken.core.kv_cache_manager import KVCacheManager
from firsttoken.core.scheduler import Scheduler
from firsttoken.engine.output_processor import OutputProcessor
from firsttoken.engine.pinned_prefix_store import KVIdentity, PinnedPrefixStore, validate_pin_id
from firsttoken.models.loaders.conversion_cache import default_cache_dir
from firsttoken.models.llama import LlamaForCausalLM
from firsttoken.models.registry import build_model, open_checkpoint, resolve_model_path
from firsttoken.ops.kernels import FUSED_MIN_TOKENS, Kernels
from firsttoken.ops.linear import onednn_packing_available
from firsttoken.ops.native import load_native_kernels
from firsttoken.outputs import EngineStats, PinnedPrefix, RequestDelta
from firsttoken.request import Request, RequestStatus, RequestTimestamps
from firsttoken.sample.sampler import Sampler
from firsttoken.sampling_params import SamplingParams
from firsttoken.worker.cost_calibration import load_or_calibrate
from firsttoken.worker.device import physical_core_count, resolve_device, resolve_dtype
from firsttoken.worker.host_memory import keep_freed_host_memory
from firsttoken.worker.kv_cache import allocate_kv_caches, num_kv_blocks
from firsttoken.worker.model_runner import ModelRunner

if TYPE_CHECKING:
    from firsttoken.worker.cuda_runner import CudaModelRunner

logger = logging.getLogger(__name__)


class EngineCore:
    """Owns the model, KV cache, scheduler, runner and output processor of one engine."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        model_config = config.model_config
        self.device = resolve_device(model_config.device)
        self.dtype = resolve_dtype(model_config.dtype, self.device)
        if self.device.type == "cpu":
            torch.set_num_threads(model_config.num_threads or physical_core_count())
            keep_freed_host_memory()
        self.model_path = resolve_model_path(model_config.model)
        self.checkpoint = open_checkpoint(self.model_path)
        self.tokenizer = self.checkpoint.tokenizer
        self.max_model_len = self._max_model_len()
        native_kernels = None
        if model_config.fuse_ops and model_config.native_kernels and self.device.type == "cpu":
            native_kernels = load_native_kernels(os.path.join(default_cache_dir(), "native"))
        backend = select_attention_backend(
            config.attention, self.device, self.checkpoint.arch.num_heads, self.checkpoint.arch.num_kv_heads,
            native_kernels,
        )
        self.kernels = Kernels(fused=model_config.fuse_ops, native_kernels=native_kernels)
        self.model = self._load_model(backend)
        # Decode graphs pad their batches with rows that write one scratch block past the manager's.
        use_graphs = self.device.type == "cuda" and model_config.cuda_graphs
        num_blocks = self._allocate_kv_cache(num_scratch_blocks=int(use_graphs))
        self.runner = self._build_runner(backend, scratch_block_id=num_blocks if use_graphs else None)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._request_counter = itertools.count()
        self.pinned: dict[str, PinnedPrefix] = {}
        self._pending_pins: dict[str, str] = {}  # internal request id -> pin id
        self.prefix_store = self._open_prefix_store()
        self._warm_up()
        if config.chunked_prefill.enable and config.chunked_prefill.chunk_size == "auto":
            self.scheduler.step_times = StepTimeTracker(self._step_cost_model())
        if self.prefix_store is not None:
            self._restore_pinned_prefixes()
        logger.info(
            "engine ready: %s (%s, %s on %s), %d KV blocks of %d tokens, max_model_len %d",
            self.model_path, self.checkpoint.arch.architecture, self.dtype, self.device, num_blocks,
            config.cache.block_size, self.max_model_len,
        )

    def _load_model(self, backend: AttentionBackend) -> LlamaForCausalLM:
        """The model's weights in this engine's dtype, then in their fastest layout here."""
        model = build_model(
            self.checkpoint, backend, self.kernels, self.dtype, self.device, self.max_model_len, cache_dir=None
        )
        model_config = self.config.model_config
        model.prepare_projections(
            model_config.quantization, model_config.quantized_prefill, onednn_packing_available(self.dtype, self.device)
        )
        return model

    def _allocate_kv_cache(self, num_scratch_blocks: int) -> int:
        """The paged KV cache, its block manager and the scheduler over it; returns the block count."""
        config = self.config
        block_size = config.cache.block_size
        num_blocks = num_kv_blocks(config.cache, self.checkpoint.arch, self.dtype, self.device)
        self.kv_caches = allocate_kv_caches(
            self.checkpoint.arch, num_blocks + num_scratch_blocks, block_size, self.dtype, self.device
        )
        self.model.bind_kv_caches(self.kv_caches)
        self.kv_manager = KVCacheManager(num_blocks, block_size, config.prompt_cache.enable)
        self.hash_root = root_hash(f"{self.checkpoint.fingerprint}|{self.dtype}|{block_size}")
        self.scheduler = Scheduler(
            config.scheduler, config.chunked_prefill, self.kv_manager, self.max_model_len, self.hash_root
        )
        return num_blocks

    def _build_runner(self, backend: AttentionBackend, scratch_block_id: int | None) -> ModelRunner | CudaModelRunner:
        config = self.config
        sampler = Sampler(config.model_config.seed, self.device)
        runner = ModelRunner(self.model, backend, sampler, config.cache.block_size, self.device)
        if self.device.type != "cuda":
            return runner
        from firsttoken.worker.cuda_runner import CudaModelRunner  # imports triton

        return CudaModelRunner.build(runner, config.scheduler.max_num_seqs, self.max_model_len, scratch_block_id)

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
        """Compile the fused ops and run a prefill and a decode on scratch blocks, so the first
        request pays no one-time cost. No request, hash or counter is touched."""
        self.kernels.warm_up(lambda num_tokens: self._run_scratch_step(0, num_tokens))
        num_tokens = min(FUSED_MIN_TOKENS, self.max_model_len - 1)
        self._run_scratch_step(0, num_tokens)
        self._run_scratch_step(num_tokens, 1)

    def _run_scratch_step(self, start: int, num_tokens: int) -> None:
        block_size = self.config.cache.block_size
        num_blocks = -(-(start + num_tokens) // block_size)
        if num_blocks > self.kv_manager.num_blocks or start + num_tokens > self.max_model_len:
            return
        chunk = ScheduledChunk(
            req_id="warm-up",
            token_ids=[0] * num_tokens,
            start_position=start,
            block_table=list(range(num_blocks)),
            sample=SampleSpec(SamplingParams(temperature=0, max_tokens=1), 0),
        )
        self.runner.execute(SchedulerOutput(chunks=[chunk], token_budget=num_tokens))

    def _step_cost_model(self) -> StepCostModel:
        threads = torch.get_num_threads() if self.device.type == "cpu" else 0
        name = (
            f"{self.checkpoint.fingerprint}-{str(self.dtype).removeprefix('torch.')}-{self.device.type}"
            f"-t{threads}-b{self.config.cache.block_size}.json"
        )
        return load_or_calibrate(
            self.runner,
            self.config.cache.block_size,
            self.kv_manager.num_blocks,
            self.config.scheduler.max_num_batched_tokens,
            os.path.join(default_cache_dir(), "step_costs", name),
        )

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
        self._pending_pins.pop(req_id, None)
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
        started = time.perf_counter()
        model_output = self.runner.execute(scheduler_output)
        self.scheduler.observe_step_time(scheduler_output, time.perf_counter() - started)
        deltas = []
        for progress in self.scheduler.update(scheduler_output, model_output):
            if progress.request.req_id in self._pending_pins:
                self._complete_pin(progress.request)
                continue
            stop_string = self.output_processor.detokenize(progress)
            if stop_string is not None:
                progress.request.stop_reason = stop_string
                self.scheduler.finish_request(progress.request.req_id, RequestStatus.FINISHED_STOPPED)
            deltas.append(self.output_processor.delta(progress))
        return deltas

    # -- pinned prefixes -----------------------------------------------------------------

    def pin_prefix(self, token_ids: list[int], pin_id: str) -> str:
        """Queue the computation of a prefix whose full blocks will then stay resident until
        unpinned; returns the internal request id. The pin exists once `pin_id in self.pinned`."""
        if not self.config.prompt_cache.enable:
            raise ValueError("pin_prefix: the prompt cache is disabled (enable_prompt_cache=False)")
        validate_pin_id(pin_id)
        block_size = self.config.cache.block_size
        if len(token_ids) < block_size:
            raise ValueError(
                f"prefix: {len(token_ids)} tokens is shorter than one KV block ({block_size} tokens); nothing to pin"
            )
        if pin_id in self.pinned or pin_id in self._pending_pins.values():
            raise ValueError(f"pin_id: {pin_id!r} is already pinned")
        req_id = f"pin:{pin_id}"
        self.add_request(req_id, list(token_ids), SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        self.output_processor.remove(req_id)
        self._pending_pins[req_id] = pin_id
        return req_id

    def unpin_prefix(self, pin_id: str) -> None:
        if pin_id not in self.pinned:
            raise ValueError(f"pin_id: no pinned prefix {pin_id!r}")
        self.kv_manager.unpin(pin_id)
        del self.pinned[pin_id]
        if self.prefix_store is not None:
            self.prefix_store.delete(pin_id)

    def reset_prefix_cache(self) -> None:
        """Forget every cached and pinned prefix (persisted pins stay on disk)."""
        self.kv_manager.reset_prefix_cache()
        self.pinned.clear()

    def _complete_pin(self, request: Request) -> None:
        pin_id = self._pending_pins.pop(request.req_id)
        num_blocks = request.num_prompt_tokens // self.config.cache.block_size
        num_tokens = self.kv_manager.pin(pin_id, request.block_hashes[:num_blocks])
        self.pinned[pin_id] = PinnedPrefix(pin_id, request.prompt_token_ids[:num_tokens])
        if self.prefix_store is not None:
            block_ids = self.kv_manager.pinned_block_ids(pin_id)
            self.prefix_store.save(
                pin_id, self.pinned[pin_id].token_ids, self.kv_manager.pinned_block_hashes(pin_id),
                self._read_blocks(block_ids),
            )

    def _open_prefix_store(self) -> PinnedPrefixStore | None:
        folder = self.config.prompt_cache.persist_dir
        if folder is None or not self.config.prompt_cache.enable:
            return None
        arch = self.checkpoint.arch
        identity = KVIdentity(
            model_fingerprint=self.checkpoint.fingerprint,
            dtype=str(self.dtype).removeprefix("torch."),
            block_size=self.config.cache.block_size,
            num_layers=arch.num_layers,
            num_kv_heads=arch.num_kv_heads,
            head_dim=arch.head_dim,
        )
        return PinnedPrefixStore(folder, identity)

    def _restore_pinned_prefixes(self) -> None:
        block_size = self.config.cache.block_size
        for stored in self.prefix_store.load_all():
            token_ids = stored.token_ids[: len(stored.block_hashes) * block_size]
            expected_hashes: list[bytes] = []
            extend_block_hashes(expected_hashes, token_ids, block_size, self.hash_root)
            if expected_hashes != stored.block_hashes or stored.pin_id in self.pinned:
                logger.warning("prompt cache: refusing %s: its hashes do not match this engine", stored.pin_id)
                continue
            block_ids = self.kv_manager.adopt_pinned_blocks(stored.pin_id, stored.block_hashes)
            if block_ids is None:
                logger.warning("prompt cache: no room to restore %s", stored.pin_id)
                continue
            self._write_blocks(block_ids, stored.kv)
            self.pinned[stored.pin_id] = PinnedPrefix(stored.pin_id, token_ids)
            logger.info("prompt cache: restored %s (%d tokens)", stored.pin_id, len(token_ids))

    def _read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """[layers, 2, blocks, block_size, kv_heads, head_dim] copy of those blocks' KV."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        return torch.stack([kv_cache.index_select(1, index) for kv_cache in self.kv_caches])

    def _write_blocks(self, block_ids: list[int], kv: torch.Tensor) -> None:
        index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        for layer, kv_cache in enumerate(self.kv_caches):
            kv_cache.index_copy_(1, index, kv[layer].to(device=self.device, dtype=kv_cache.dtype))

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
        )

