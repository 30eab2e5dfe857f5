"""Worker: runs the steps of one rank.

The executor (executor.py) builds it in three phases, joining the ranks between them: the
constructor places it (device, threads, checkpoint, the slice of the model it holds),
`load_model()` loads the weights, and `allocate_kv_cache()` allocates the paged KV tensors at
the block count every rank holds and builds the runner. Then the executor hands it each step.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator

import torch

from firsttoken.config import EngineConfig
from firsttoken.core.batch import ModelOutput, SchedulerOutput
from firsttoken.core.cost_model import StepCostModel
from firsttoken.models.loaders.conversion_cache import default_cache_dir
from firsttoken.models.registry import open_checkpoint, resolve_model_path
from firsttoken.ops.cpu_info import physical_core_count
from firsttoken.outputs import WHOLE_STEP_INT4_DECODE, WHOLE_STEP_W8A8, GraphCaptureReport
from firsttoken.sample.sampler import Sampler
from firsttoken.tokenizer import Tokenizer
from firsttoken.worker.batch_invariance import claims_batch_invariance
from firsttoken.worker.checkpoint_quantization import check_checkpoint_quantization
from firsttoken.worker.compute_form import resolve_compute
from firsttoken.worker.device import resolve_device
from firsttoken.worker.host_memory import keep_freed_host_memory
from firsttoken.worker.kv_cache import allocate_kv_caches, num_kv_blocks, prefault_kv_caches
from firsttoken.worker.model_loading import (
    ModelPlacement,
    attention_arch_of,
    load_model,
    max_model_len,
)
from firsttoken.worker.model_runner import ModelRunner
from firsttoken.worker.pinned_prefix_kv import PinnedPrefixKV, open_prefix_store
from firsttoken.worker.pinned_prefix_store import StoredPrefix, projections_form
from firsttoken.worker.tensor_parallel import RankGroup
from firsttoken.worker.thread_governor import ThreadGovernor

logger = logging.getLogger(__name__)


class Worker:
    """Owns one rank's device and threads, its model (or its slice of the model) with the
    kernels and attention backend, the paged KV tensors, the runner and its CUDA graphs, the
    thread governor, and the copies of pinned prefixes' KV.

    With a `rank_group` it holds the slice of the model and of the KV cache that the group
    gives it, and samples only where the group says so."""

    def __init__(self, config: EngineConfig, rank_group: RankGroup | None = None) -> None:
        self.config = config
        model_config = config.model_config
        self.rank_group = rank_group
        self.device = rank_group.device if rank_group is not None else resolve_device(model_config.device)
        # Each rank gets its share of the cores: more threads than cores would stall every op.
        world_size = config.parallel.tensor_parallel_size
        self.num_threads = model_config.num_threads or max(1, physical_core_count() // world_size)
        if self.device.type == "cpu":
            torch.set_num_threads(self.num_threads)
            keep_freed_host_memory()
        self.cache_dir = model_config.cache_dir or default_cache_dir()
        self.model_path = resolve_model_path(model_config.model)
        self.checkpoint = open_checkpoint(self.model_path, self.cache_dir)
        # Run as given: the engine resolved the checkpoint's quantization into it, for every rank.
        check_checkpoint_quantization(config, self.checkpoint, self.device)
        self.compute = resolve_compute(config, self.checkpoint, self.device, self.cache_dir, self.num_threads)
        self.dtype = self.compute.dtype
        self.max_model_len = max_model_len(self.checkpoint.arch, model_config.max_model_len)
        shard = rank_group.shard_of(self.checkpoint.arch) if rank_group is not None else None
        self.placement = ModelPlacement(
            self.device,
            self.dtype,
            self.compute.batch_invariant,
            self.max_model_len,
            self.cache_dir,
            shard,
            rank_group,
        )
        # Set by govern_threads(): the cost model's predictions are what steps are measured against.
        self._step_cost: StepCostModel | None = None
        self.thread_governor: ThreadGovernor | None = None

    def load_model(self) -> None:
        """Load the model (this rank's slice of it) in its fastest form here."""
        loaded = load_model(self.config, self.checkpoint, self.placement)
        self.model, self.backend, self.kernels = loaded.model, loaded.backend, loaded.kernels
        self.flash_limit = loaded.flash_limit
        # Held while this worker lives: engines started after it share these weights.
        self.shared_weights = loaded.shared_weights
        self.batch_invariant = claims_batch_invariance(
            self.config,
            self.compute.batch_invariant,
            self.model,
            self.backend,
            self.kernels,
            self.dtype,
            self.device,
        )

    def num_kv_blocks_that_fit(self) -> int:
        """Blocks this rank's KV cache can hold."""
        shard = self.placement.shard
        attention_arch = attention_arch_of(self.checkpoint.arch, shard)
        kv_share = shard.kv_share if shard is not None else 1.0
        return num_kv_blocks(self.config.cache, attention_arch, self.dtype, self.device, kv_share)

    def allocate_kv_cache(self, num_kv_blocks: int) -> None:
        """The paged KV tensors of `num_kv_blocks` blocks (every rank holds the same block ids),
        the runner on them and its CUDA graphs."""
        config = self.config
        self.num_kv_blocks = num_kv_blocks
        # Graphs pad their steps with tokens that write one scratch block past the manager's.
        use_graphs = self.device.type == "cuda" and config.model_config.cuda_graphs
        self.kv_caches = allocate_kv_caches(
            attention_arch_of(self.checkpoint.arch, self.placement.shard),
            num_kv_blocks + int(use_graphs),
            config.cache.block_size,
            self.dtype,
            self.device,
        )
        if config.cache.prefault_kv_cache and self.device.type == "cpu":
            prefault_kv_caches(self.kv_caches)
        self.model.bind_kv_caches(self.kv_caches)
        samples = self.rank_group is None or self.rank_group.samples
        sampler = None
        if samples:
            sampler = Sampler(config.model_config.seed, self.device, self.vocab_size, self.kernels.native)
        self.runner = ModelRunner(self.model, self.backend, sampler, config.cache.block_size, self.device)
        self.graph_capture: GraphCaptureReport | None = self._capture_graphs() if use_graphs else None
        self.pinned_kv = PinnedPrefixKV(
            open_prefix_store(config, self.checkpoint, self.dtype), self.kv_caches, self.device
        )

    def _capture_graphs(self) -> GraphCaptureReport:
        # Every rank captures the same sizes in the same order: the collectives inside match.
        config = self.config
        capture = self.runner.capture_graphs(
            config.scheduler.max_num_seqs,
            self.max_model_len,
            min(config.model_config.cuda_graph_max_tokens, config.scheduler.max_num_batched_tokens),
            scratch_block_id=self.num_kv_blocks,
        )
        logger.info(
            "captured CUDA graphs for decode batch sizes %s and step token counts %s in %.2f s, "
            "%.1f MiB of device memory",
            list(capture.batch_sizes),
            list(capture.token_sizes),
            capture.seconds,
            capture.device_memory_bytes / 2**20,
        )
        return capture

    @property
    def tokenizer(self) -> Tokenizer:
        return self.checkpoint.tokenizer

    @property
    def vocab_size(self) -> int:
        return self.checkpoint.arch.vocab_size

    @property
    def kv_identity(self) -> str:
        """What makes this worker's KV of a token sequence the same as another's (float projections
        add nothing, so a float engine's hashes stay those of earlier versions)."""
        identity = f"{self.checkpoint.fingerprint}|{self.dtype}|{self.config.cache.block_size}"
        model_config = self.config.model_config
        projections = projections_form(model_config)
        return identity if projections == "float" else f"{identity}|{projections}"

    @property
    def tensor_parallel_size(self) -> int:
        return self.config.parallel.tensor_parallel_size

    def describe(self) -> str:
        ranks = (
            f", {self.tensor_parallel_size} tensor-parallel ranks" if self.tensor_parallel_size > 1 else ""
        )
        return (
            f"{self.model_path} ({self.checkpoint.arch.architecture}, {self.dtype} on {self.device}"
            f"{self._kernels_description()}{ranks})"
        )

    def describe_choices(self) -> list[str]:
        """The start-up log's lines on what this worker chose and why: dtype, batch invariance,
        and where measured, the longest prompt the native prefill attention keeps."""
        compute = self.compute
        if compute.batch_invariant and not self.batch_invariant:
            invariance = (
                f"{compute.invariance_reason}, but not held here (quantized weights, or kernels without it: "
                "any warning above says which)"
            )
        elif self.batch_invariant:
            invariance = (
                f"{compute.invariance_reason}: a request's tokens are the same bits whatever runs beside it"
            )
        else:
            invariance = f"{compute.invariance_reason}: the fastest kernels for each step's rows"
        flash_limit = [self.flash_limit.reason] if self.flash_limit is not None else []
        return [compute.dtype_reason, invariance, *flash_limit]

    @property
    def native_isa(self) -> str | None:
        """The ISA the native CPU kernels were built for; None where torch ops run."""
        native_kernels = self.kernels.native if self.device.type == "cpu" else None
        return native_kernels.isa if native_kernels is not None else None

    @property
    def whole_step_forwards(self) -> tuple[str, ...]:
        """The runner's whole-step native forwards: int4 decode steps, W8A8 steps."""
        forwards = (
            (WHOLE_STEP_INT4_DECODE, self.runner.whole_step_decode),
            (WHOLE_STEP_W8A8, self.runner.whole_step_w8a8),
        )
        return tuple(name for name, forward in forwards if forward is not None)

    @contextlib.contextmanager
    def forward_op_by_op(self) -> Iterator[tuple[str, ...]]:
        """The runner's whole-step native forwards set aside while inside, so every step runs the
        model's forward op by op: the per-op path a benchmark compares with, and the modules a
        profiler's hooks can time (a step in one native call has no stages to see). Yields the
        names of those set aside (see `whole_step_forwards`); puts them back after."""
        runner = self.runner
        set_aside = self.whole_step_forwards
        whole_step_decode, whole_step_w8a8 = runner.whole_step_decode, runner.whole_step_w8a8
        runner.whole_step_decode = runner.whole_step_w8a8 = None
        try:
            yield set_aside
        finally:
            runner.whole_step_decode, runner.whole_step_w8a8 = whole_step_decode, whole_step_w8a8

    def _kernels_description(self) -> str:
        if self.device.type != "cpu":
            return ""
        return f", native kernels for {self.native_isa}" if self.native_isa is not None else ", torch ops"

    # -- steps ---------------------------------------------------------------------------

    @property
    def adapts_threads(self) -> bool:
        """Whether steps choose their thread count (needs `govern_threads()` called once)."""
        # Not with ranks: a step waits for the slowest rank, whatever the driver's threads.
        return (
            self.device.type == "cpu" and self.config.model_config.adaptive_threads and self.num_threads > 1
            and self.tensor_parallel_size == 1
        )

    def govern_threads(self, step_cost: StepCostModel) -> None:
        """Measure steps against `step_cost`'s predictions, choosing their threads where
        `adapts_threads`."""
        self._step_cost = step_cost
        if self.adapts_threads:
            self.thread_governor = ThreadGovernor(self.num_threads)

    def execute(self, scheduler_output: SchedulerOutput) -> ModelOutput:
        if self.device.type != "cpu":
            return self.runner.execute(scheduler_output)
        governor = self.thread_governor
        threads = governor.threads() if governor is not None else self.num_threads
        # Per calling thread in OpenMP: the server steps on another thread than the one that loaded.
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        started = time.perf_counter()
        output = self.runner.execute(scheduler_output)
        # The step cost model knows nothing of scored prompt rows: measured against it, a scoring
        # step looks like a contended machine (1024 scored rows moved 2 cores to 1 for 5 s).
        if governor is not None and not scheduler_output.scores_prompts:
            finished = time.perf_counter()
            governor.observe(threads, finished - started, self._predicted_seconds(scheduler_output), finished)
        return output

    def _predicted_seconds(self, scheduler_output: SchedulerOutput) -> float:
        assert self._step_cost is not None
        return self._step_cost.predict_chunks(scheduler_output.chunks)

    def release_requests(self, req_ids: list[str]) -> None:
        """Free the sampler's token state of finished tracked requests."""
        assert self.runner.sampler is not None  # the driver's worker: the engine's requests end there
        self.runner.sampler.release(req_ids)

    # -- pinned prefixes on disk ---------------------------------------------------------

    def stored_prefixes(self) -> list[StoredPrefix]:
        return self.pinned_kv.stored()

    def save_prefix(
        self, pin_id: str, token_ids: list[int], block_hashes: list[bytes], block_ids: list[int]
    ) -> None:
        self.pinned_kv.save(pin_id, token_ids, block_hashes, block_ids)

    def delete_prefix(self, pin_id: str) -> None:
        self.pinned_kv.delete(pin_id)

    def restore_prefix(self, stored: StoredPrefix, block_ids: list[int]) -> None:
        self.pinned_kv.restore(stored, block_ids)
