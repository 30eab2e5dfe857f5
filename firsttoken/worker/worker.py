"""Worker: everything of one engine that holds or touches tensors.

The engine core (engine/engine_core.py) schedules and bookkeeps in plain Python; it hands the
worker a SchedulerOutput per step and gets a ModelOutput back, and asks it for block copies
of pinned prefixes by block id.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from types import ModuleType
from typing import TYPE_CHECKING

import torch

from firsttoken.attention.backend import AttentionBackend
from firsttoken.attention.selector import select_attention_backend
from firsttoken.config import EngineConfig
from firsttoken.core.batch import ModelOutput, SampleSpec, ScheduledChunk, SchedulerOutput
from firsttoken.core.cost_model import StepCostModel, attention_pairs
from firsttoken.errors import InvalidInputError, TensorParallelError
from firsttoken.models.arch import ModelArch
from firsttoken.models.llama import LlamaForCausalLM
from firsttoken.models.loaders.conversion_cache import default_cache_dir
from firsttoken.models.registry import build_model, open_checkpoint, resolve_model_path
from firsttoken.models.sharding import ModelShard, shard_for_rank
from firsttoken.ops.cpu_info import physical_core_count
from firsttoken.ops.kernels import FUSED_MIN_TOKENS, Kernels
from firsttoken.ops.linear import onednn_packing_available
from firsttoken.ops.native import load_native_kernels
from firsttoken.sample.sampler import Sampler
from firsttoken.sampling_params import SamplingParams
from firsttoken.tokenizer import Tokenizer
from firsttoken.worker.batch_invariance import claims_batch_invariance
from firsttoken.worker.cost_calibration import CalibrationLimits, load_or_calibrate
from firsttoken.worker.device import resolve_device, resolve_dtype
from firsttoken.worker.host_memory import keep_freed_host_memory
from firsttoken.worker.kv_cache import allocate_kv_caches, available_memory_bytes, num_kv_blocks
from firsttoken.worker.model_runner import ModelRunner
from firsttoken.worker.pinned_prefix_kv import PinnedPrefixKV, open_prefix_store
from firsttoken.worker.pinned_prefix_store import StoredPrefix
from firsttoken.worker.tensor_parallel import RankGroup, RankProcesses, RankStart, rank_device
from firsttoken.worker.thread_governor import ThreadGovernor

if TYPE_CHECKING:
    from firsttoken.worker.cuda_graphs import GraphCaptureReport

logger = logging.getLogger(__name__)


class Worker:
    """Owns the device and its threads, the kernels, the model, the paged KV tensors and block
    copies, the runner, the warm-up and the step-cost calibration, the pinned-prefix files.

    With `tensor_parallel_size` N > 1 it is one rank of N, holding a slice of the model and of
    the KV cache: rank 0 (the engine's worker) starts ranks 1..N-1 in their own processes and
    sends them every step it runs (tensor_parallel.py); they are started with their `rank_start`."""

    def __init__(self, config: EngineConfig, rank_start: RankStart | None = None) -> None:
        self.config = config
        model_config = config.model_config
        world_size = config.parallel.tensor_parallel_size
        self.device = resolve_device(model_config.device)
        self.dtype = resolve_dtype(model_config.dtype, self.device)
        # Each rank gets its share of the cores: more threads than cores would stall every op.
        self.num_threads = model_config.num_threads or max(1, physical_core_count() // world_size)
        if self.device.type == "cpu":
            torch.set_num_threads(self.num_threads)
            keep_freed_host_memory()
        # Set by step_cost_model(): its predictions are what the governor measures steps against.
        self._calibrated: StepCostModel | None = None
        self.thread_governor: ThreadGovernor | None = None
        self.cache_dir = model_config.cache_dir or default_cache_dir()
        self.model_path = resolve_model_path(model_config.model)
        self.checkpoint = open_checkpoint(self.model_path, self.cache_dir)
        self.max_model_len = self._max_model_len()
        arch = self.checkpoint.arch
        self.rank_processes: RankProcesses | None = None
        self.rank_group: RankGroup | None = None
        self.rank_start = rank_start
        shard = None
        if world_size > 1:
            shard = self._start_ranks(rank_start.rank if rank_start is not None else 0)
        native_kernels = None
        if model_config.fuse_ops and model_config.native_kernels and self.device.type == "cpu":
            native_kernels = load_native_kernels(os.path.join(self.cache_dir, "native"), model_config.cpu_isa)
            if native_kernels is not None:
                logger.info("native CPU kernels built for %s", native_kernels.isa)
        attention_arch = shard.attention_arch(arch) if shard is not None else arch
        backend = select_attention_backend(
            config.attention,
            self.device,
            attention_arch.num_heads,
            attention_arch.num_kv_heads,
            native_kernels,
            batch_invariant=model_config.batch_invariant,
        )
        self.kernels = Kernels(
            fused=model_config.fuse_ops, native_kernels=native_kernels, triton_ops=_triton_ops(self.device)
        )
        self.model = self._load_model(backend, shard)
        self.batch_invariant = claims_batch_invariance(
            config, self.model, backend, self.kernels, self.dtype, self.device
        )
        # Graphs pad their steps with tokens that write one scratch block past the manager's.
        use_graphs = self.device.type == "cuda" and model_config.cuda_graphs
        self.num_kv_blocks = self._num_kv_blocks(attention_arch, shard)
        if self.rank_group is not None:
            self.rank_group.connect(self._init_method())
        self.kv_caches = allocate_kv_caches(
            attention_arch,
            self.num_kv_blocks + int(use_graphs),
            config.cache.block_size,
            self.dtype,
            self.device,
        )
        if config.cache.prefault_kv_cache and self.device.type == "cpu":
            self._prefault_kv_cache()
        self.model.bind_kv_caches(self.kv_caches)
        sampler = Sampler(model_config.seed, self.device, arch.vocab_size)
        send_step = self.rank_processes.send_step if self.rank_processes is not None else None
        self.runner = ModelRunner(
            self.model, backend, sampler, config.cache.block_size, self.device, send_step
        )
        self.graph_capture: GraphCaptureReport | None = None
        if use_graphs:
            # Every rank captures the same sizes in the same order: the collectives inside match.
            self.graph_capture = self.runner.capture_graphs(
                config.scheduler.max_num_seqs,
                self.max_model_len,
                min(model_config.cuda_graph_max_tokens, config.scheduler.max_num_batched_tokens),
                scratch_block_id=self.num_kv_blocks,
            )
            logger.info(
                "captured CUDA graphs for decode batch sizes %s and step token counts %s in %.2f s, "
                "%.1f MiB of device memory",
                list(self.graph_capture.batch_sizes),
                list(self.graph_capture.token_sizes),
                self.graph_capture.seconds,
                self.graph_capture.device_memory_bytes / 2**20,
            )
        self.pinned_kv = PinnedPrefixKV(
            open_prefix_store(config, self.checkpoint, self.dtype), self.kv_caches, self.device
        )

    def _start_ranks(self, rank: int) -> ModelShard:
        """This rank's slice; rank 0 first starts the others. The process group forms later,
        once every rank has loaded (`_num_kv_blocks`)."""
        config = self.config
        # Checked before any process starts: a split that cannot be fails here, in the driver.
        shard = shard_for_rank(self.checkpoint.arch, rank, config.parallel.tensor_parallel_size)
        if config.prompt_cache.persist_dir is not None and config.prompt_cache.enable:
            raise InvalidInputError(
                "prompt_cache_dir",
                "persisted pinned prefixes need tensor_parallel_size 1 (each rank holds a KV slice)",
            )
        self.device = rank_device(self.device, rank)
        self.rank_group = RankGroup(config.parallel, self.device, rank)
        if rank == 0:
            self.rank_processes = RankProcesses(config)
        return shard

    def _init_method(self) -> str:
        if self.rank_processes is not None:
            return self.rank_processes.init_method
        assert self.rank_start is not None
        return self.rank_start.init_method

    @property
    def tokenizer(self) -> Tokenizer:
        return self.checkpoint.tokenizer

    @property
    def vocab_size(self) -> int:
        return self.checkpoint.arch.vocab_size

    @property
    def kv_identity(self) -> str:
        """What makes this worker's KV of a token sequence the same as another's."""
        return f"{self.checkpoint.fingerprint}|{self.dtype}|{self.config.cache.block_size}"

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

    def _kernels_description(self) -> str:
        if self.device.type != "cpu":
            return ""
        native_kernels = self.kernels.native
        return f", native kernels for {native_kernels.isa}" if native_kernels is not None else ", torch ops"

    def _num_kv_blocks(self, attention_arch: ModelArch, shard: ModelShard | None) -> int:
        """Blocks every rank holds: ranks share block ids, so the smallest count serves all.
        On the CPU the ranks share one memory budget: each takes its KV heads' part of it."""
        cache = self.config.cache
        if shard is None:
            return num_kv_blocks(cache, attention_arch, self.dtype, self.device)
        if self.device.type == "cpu":
            budget = cache.kv_cache_memory_bytes
            if budget is None:
                budget = int(available_memory_bytes(self.device) * cache.kv_cache_memory_fraction)
            cache = dataclasses.replace(cache, kv_cache_memory_bytes=max(1, int(budget * shard.kv_share)))
        num_blocks = num_kv_blocks(cache, attention_arch, self.dtype, self.device)
        if self.rank_processes is not None:
            return self.rank_processes.agree_on_num_blocks(num_blocks)
        assert self.rank_start is not None
        return self.rank_start.agree_on_num_blocks(num_blocks)

    def _load_model(self, backend: AttentionBackend, shard: ModelShard | None) -> LlamaForCausalLM:
        """The model's weights in this engine's dtype, then in their fastest layout here."""
        model = build_model(
            self.checkpoint,
            backend,
            self.kernels,
            self.dtype,
            self.device,
            self.max_model_len,
            self.cache_dir,
        )
        if shard is not None:
            model.shard(shard, self.rank_group)
        model_config = self.config.model_config
        model.prepare_projections(
            model_config.quantization,
            model_config.quantized_prefill,
            onednn_packing_available(self.dtype, self.device),
            batch_invariant=model_config.batch_invariant,
            triton_matmuls=self.device.type == "cuda",
        )
        return model

    def _max_model_len(self) -> int:
        arch = self.checkpoint.arch
        limit = arch.max_position_embeddings
        if arch.sliding_window:
            limit = min(limit, arch.sliding_window)  # full attention is exact up to the window
        requested = self.config.model_config.max_model_len
        if requested is not None and requested > limit:
            raise InvalidInputError(
                "max_model_len", f"{requested} exceeds the model's limit of {limit} tokens"
            )
        return requested or limit

    # -- steps ---------------------------------------------------------------------------

    @property
    def adapts_threads(self) -> bool:
        """Whether steps choose their thread count (needs `step_cost_model()` called once)."""
        # Not with ranks: a step waits for the slowest rank, whatever the driver's threads.
        return (
            self.device.type == "cpu" and self.config.model_config.adaptive_threads and self.num_threads > 1
            and self.tensor_parallel_size == 1
        )

    def execute(self, scheduler_output: SchedulerOutput) -> ModelOutput:
        if self.rank_processes is None:
            return self._execute(scheduler_output)
        try:
            return self._execute(scheduler_output)
        except TensorParallelError:
            raise
        except (RuntimeError, OSError) as error:  # a collective failed or timed out
            raise self.rank_processes.fail(error) from error

    def shutdown(self) -> None:
        """Stop the other ranks and leave the process group (nothing to do with one rank)."""
        if self.rank_processes is not None:
            self.rank_processes.shutdown()

    def _execute(self, scheduler_output: SchedulerOutput) -> ModelOutput:
        if self.device.type != "cpu":
            return self.runner.execute(scheduler_output)
        governor = self.thread_governor
        threads = governor.threads() if governor is not None else self.num_threads
        # Per calling thread in OpenMP: the server steps on another thread than the one that loaded.
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        started = time.perf_counter()
        output = self.runner.execute(scheduler_output)
        if governor is not None:
            finished = time.perf_counter()
            governor.observe(threads, finished - started, self._predicted_seconds(scheduler_output), finished)
        return output

    def release_requests(self, req_ids: list[str]) -> None:
        """Free the sampler's token state of finished tracked requests."""
        self.runner.sampler.release(req_ids)

    def _predicted_seconds(self, scheduler_output: SchedulerOutput) -> float:
        assert self._calibrated is not None
        pairs = sum(
            attention_pairs(chunk.start_position, chunk.num_tokens) for chunk in scheduler_output.chunks
        )
        return self._calibrated.predict(scheduler_output.num_tokens, pairs)

    def warm_up(self) -> None:
        """Compile the fused ops and run a prefill and a decode on scratch blocks, so the first
        request pays no one-time cost. Call before any request holds a block."""
        self.kernels.warm_up(lambda num_tokens: self._run_scratch_step(0, num_tokens))
        num_tokens = min(FUSED_MIN_TOKENS, self.max_model_len - 1)
        self._run_scratch_step(0, num_tokens)
        self._run_scratch_step(num_tokens, 1)

    def _prefault_kv_cache(self) -> None:
        """Write the whole KV cache once, so its pages are mapped before requests arrive.

        On the CPU the cache starts as lazily mapped zero pages (see `allocate_kv_caches`).
        With the prompt cache on, finished requests keep their blocks cached and new ones take
        never-written blocks, so every prompt would pay the page faults of its KV (~30 ms of a
        512-token prefill here) until the whole cache had been written once. A server pays
        that once at start instead (~1 s per GB, on torch's threads)."""
        started = time.perf_counter()
        with torch.inference_mode():
            for cache in self.kv_caches:
                cache.zero_()
        logger.info(
            "wrote the %d-block KV cache in %.2f s", self.num_kv_blocks, time.perf_counter() - started
        )

    def _run_scratch_step(self, start: int, num_tokens: int) -> None:
        block_size = self.config.cache.block_size
        num_blocks = -(-(start + num_tokens) // block_size)
        if num_blocks > self.num_kv_blocks or start + num_tokens > self.max_model_len:
            return
        chunk = ScheduledChunk(
            req_id="warm-up",
            token_ids=[0] * num_tokens,
            start_position=start,
            block_table=list(range(num_blocks)),
            sample=SampleSpec(SamplingParams(temperature=0, max_tokens=1), 0, "warm-up"),
        )
        self.runner.execute(SchedulerOutput(chunks=[chunk]))

    def step_cost_model(self) -> StepCostModel:
        """This device's step cost, measured on scratch blocks (or cached from an earlier
        measurement that still holds). Call before any request holds a block."""
        threads = self.num_threads if self.device.type == "cpu" else 0
        name = (
            f"{self.checkpoint.fingerprint}-{str(self.dtype).removeprefix('torch.')}-{self.device.type}"
            f"-t{threads}-b{self.config.cache.block_size}{self._ranks_suffix()}.json"
        )
        limits = CalibrationLimits(
            block_size=self.config.cache.block_size,
            num_blocks=self.num_kv_blocks,
            max_batched_tokens=self.config.scheduler.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
        )
        self._calibrated = load_or_calibrate(
            self.runner, limits, os.path.join(self.cache_dir, "step_costs", name)
        )
        if self.adapts_threads:
            self.thread_governor = ThreadGovernor(self.num_threads)
        return self._calibrated

    def _ranks_suffix(self) -> str:
        return f"-tp{self.tensor_parallel_size}" if self.tensor_parallel_size > 1 else ""

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


def _triton_ops(device: torch.device) -> ModuleType | None:
    """The Triton kernels of the elementwise ops on CUDA; None elsewhere."""
    if device.type != "cuda":
        return None
    # Imported here: triton is needed on CUDA only (where the attention backend needs it too).
    from firsttoken.ops import triton_ops

    return triton_ops
