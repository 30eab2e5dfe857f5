"""Engine configuration: one frozen dataclass per subsystem, composed into EngineConfig.

Every field carries a one-line help text (with its unit) in its metadata; the CLI and the
server build their flags from these, so a new field is a new flag everywhere at once.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
import types
import typing
from typing import Any, Literal, Union

from firsttoken.errors import InvalidInputError
from firsttoken.limits import MAX_MILLISECONDS, MAX_SECONDS

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
QUANTIZATIONS = ("int8", "int4", "w8a8")
ATTENTION_BACKENDS = ("auto", "sdpa", "triton")
# Instruction sets the native CPU kernels build for (firsttoken/ops/cpu_isa.py).
CPU_ISAS = ("auto", "avx2", "avx512", "avx512_bf16")
# Sets `cpu_isa`'s default, so a whole test or benchmark run can be forced onto one CPU class.
CPU_ISA_ENVIRONMENT_VARIABLE = "FIRSTTOKEN_ISA"
SPECULATIVE_METHODS = ("ngram", "draft")
# Process-group backends chosen by `distributed_backend=auto`; any other name passes through
# to torch.distributed (an accelerator's own, such as hccl).
DEFAULT_DISTRIBUTED_BACKENDS = {"cpu": "gloo", "cuda": "nccl"}
# A step with prefill tokens this many decode steps long already bounds nothing a client sees.
MAX_STALL_FACTOR = 10_000
# The engine's seed takes what a request's may (torch's generators read it as 64 bits).
SEED_RANGE = (-(2**63), 2**64 - 1)


def _help(text: str, **extra: Any) -> dict[str, Any]:
    return {"help": text, **extra}


def _require(condition: bool, field_name: str, message: str) -> None:
    if not condition:
        raise InvalidInputError(field_name, message)


def _require_in_range(
    value: float | None, field_name: str, low: float, high: float, *, low_open: bool = False
) -> None:
    """`value` (None: unset) is a finite number in [low, high], or (low, high] when `low_open`.
    Checked as a range, not as a negated comparison: nan fails no `<` and would pass as valid."""
    if value is None:
        return
    above_low = value > low if low_open else value >= low
    finite = isinstance(value, int) or math.isfinite(value)
    interval = f"{'(' if low_open else '['}{low}, {high}]"
    _require(
        finite and above_low and value <= high,
        field_name,
        f"must be a finite number in {interval}, got {value}",
    )


@dataclass(frozen=True)
class ModelConfig:
    """Which weights to run, in which dtype, on which device."""

    model: str | None = field(
        default=None,
        metadata=_help("GGUF file or Hugging Face folder; default: the embedded SmolLM2-135M-Instruct"),
    )
    dtype: str = field(
        default="auto",
        metadata=_help(
            "compute dtype: auto | float32 | bfloat16 | float16; auto on a cpu with native kernels: "
            "bfloat16 where it prefills over 1.1x as fast as float32, timed at start (cached), else "
            "float32; on cuda: bfloat16",
            choices=DTYPES,
        ),
    )
    device: str = field(
        default="auto", metadata=_help("device: auto | cpu | cuda", choices=DEVICES)
    )
    max_model_len: int | None = field(
        default=None,
        metadata=_help("longest context (prompt + output) in tokens; default: the model's own"),
    )
    seed: int = field(default=0, metadata=_help("seed of the sampler for requests without a seed"))
    num_threads: int | None = field(
        default=None, metadata=_help("CPU threads for compute; default: the physical cores")
    )
    batch_invariant: bool | str = field(
        default="auto",
        metadata=_help(
            "auto: on where it makes a prefill and a decode step at most 1.05x as long on this machine "
            "(timed at start, cached), else off (cpu with native kernels; elsewhere on); "
            "on: unquantized (cpu: bf16, or float32 with native kernels; cuda: one rank): a "
            "request's tokens and logprobs are the same bits whatever else runs in its steps, chunked, "
            "cached or recomputed (cpu: bf16 one-row matmuls run as two rows, float32 projections on "
            "a row-invariant native matmul, decode rows attend with the prefill kernel's arithmetic; "
            "cuda: projections "
            "on a fixed-tile Triton matmul, every attention row on the chunk kernel's tiles); off: "
            "oneDNN's one-row kernel and an exact-softmax decode kernel (cuda: cuBLAS, SDPA prefills)"
        ),
    )
    adaptive_threads: bool = field(
        default=True,
        metadata=_help("cpu: run steps on fewer threads while another process keeps a core busy (a "
                       "straggler thread would stall every parallel op), back to all once it is gone"),
    )
    fuse_ops: bool = field(
        default=True,
        metadata=_help("fuse norms, rotary, SwiGLU and the KV write (native kernels on CPU, else "
                       "torch.compile from 512 tokens), built at start; off: plain torch ops"),
    )
    native_kernels: bool = field(
        default=True,
        metadata=_help("cpu: hand-written C kernels (norms, rotary, SwiGLU, KV write, AMX prefill attention) "
                       "built with the machine's compiler at start; off: torch ops (compiled when fuse_ops)"),
    )
    cpu_isa: str = field(
        default_factory=lambda: os.environ.get(CPU_ISA_ENVIRONMENT_VARIABLE, "auto"),
        metadata=_help(
            "cpu: the instruction set the native kernels are built for: auto (this CPU's own), avx2 "
            "(AVX2 + FMA), avx512 (AVX-512 F/BW/DQ/VL, no BF16), avx512_bf16; a narrower one runs the "
            f"kernels of that CPU class here; default: ${CPU_ISA_ENVIRONMENT_VARIABLE}, else auto",
            choices=CPU_ISAS,
            environment=CPU_ISA_ENVIRONMENT_VARIABLE,
        ),
    )
    cuda_graphs: bool = field(
        default=True,
        metadata=_help(
            "cuda: replay steps from CUDA graphs captured at start: decode-only steps for batch sizes "
            "1, 2, 4, 8, 16, then every 16 up to max_num_seqs; steps with prefill rows by token count "
            "(see cuda_graph_max_tokens)"
        ),
    )
    cuda_graph_max_tokens: int = field(
        default=2048,
        metadata=_help(
            "cuda: the longest step with prefill rows replayed from a graph (token counts 16, 32, 48, "
            "64, 96, 128, then every 64 to 512, 128 to 1024, 256 beyond; capped by "
            "max_num_batched_tokens); longer steps and 0 run eagerly, fresh prompts on SDPA flash"
        ),
    )
    quantization: str | None = field(
        default=None,
        metadata=_help("quantization of the projections: weight-only for decode, int8 or int4 (CPU; "
                       "exact for a Q4_1 GGUF's layers; the LM head stays int8); or w8a8 (CPU: fast with "
                       "VNNI or AMX-INT8, exact but slower than float on AVX2): int8 weights and "
                       "per-token int8 activations for prefill and decode, the LM head float; default: "
                       "none (w8a8 for a W8A8 compressed-tensors checkpoint)",
                       choices=QUANTIZATIONS),
    )
    quantized_prefill: bool = field(
        default=False,
        metadata=_help("with int8 or int4, run prefill on the quantized weights too and drop the float "
                       "copy (less memory, slower prefill); default: float weights serve prefill (w8a8 "
                       "always runs prefill quantized)"),
    )
    w8a8_activation_stats: str | None = field(
        default=None,
        metadata=_help("with w8a8: a file of the projections' input maxima from `firsttoken quantize`, "
                       "which smooths activation outliers into the weights (SmoothQuant); default: none"),
    )
    w8a8_rotation: bool = field(
        default=False,
        metadata=_help("with w8a8: turn the residual stream, each head's values and down_proj's inputs by "
                       "orthogonal matrices first (QuaRot; folded into the weights, but for a Hadamard "
                       "transform of down_proj's inputs per step), which spreads activation outliers over "
                       "all channels; needs no calibration; default: off"),
    )
    w8a8_weights: str | None = field(
        default=None,
        metadata=_help("with w8a8 and w8a8_rotation: a file of the turned projections' int8 weights rounded "
                       "by GPTQ, from `firsttoken quantize --method gptq`; default: none (rounded to "
                       "nearest at load)"),
    )
    cache_dir: str | None = field(
        default=None,
        metadata=_help("folder for converted weights, built kernels and measured step costs; default: "
                       "$XDG_CACHE_HOME/firsttoken, else ~/.cache/firsttoken"),
    )

    def __post_init__(self) -> None:
        _require(self.dtype in DTYPES, "dtype", f"must be one of {DTYPES}, got {self.dtype!r}")
        _require(
            isinstance(self.batch_invariant, bool) or self.batch_invariant == "auto",
            "batch_invariant",
            f"must be True, False or 'auto', got {self.batch_invariant!r}",
        )
        _require(
            self.cuda_graph_max_tokens >= 0,
            "cuda_graph_max_tokens",
            f"must be >= 0, got {self.cuda_graph_max_tokens}",
        )
        _require(self.device in DEVICES, "device", f"must be one of {DEVICES}, got {self.device!r}")
        _require(self.cpu_isa in CPU_ISAS, "cpu_isa", f"must be one of {CPU_ISAS}, got {self.cpu_isa!r}")
        _require(
            self.max_model_len is None or self.max_model_len >= 1,
            "max_model_len",
            f"must be >= 1, got {self.max_model_len}",
        )
        _require(
            self.quantization is None or self.quantization in QUANTIZATIONS,
            "quantization",
            f"must be one of {QUANTIZATIONS} or unset, got {self.quantization!r}",
        )
        _require(
            self.w8a8_activation_stats is None or self.quantization == "w8a8",
            "w8a8_activation_stats",
            f"applies to quantization='w8a8' only, not {self.quantization!r}",
        )
        _require(
            not self.w8a8_rotation or self.quantization == "w8a8",
            "w8a8_rotation",
            f"applies to quantization='w8a8' only, not {self.quantization!r}",
        )
        _require(
            not (self.w8a8_rotation and self.w8a8_activation_stats is not None),
            "w8a8_rotation",
            "cannot be combined with w8a8_activation_stats (its maxima are of the unturned model's "
            "inputs): use one",
        )
        _require(
            self.w8a8_weights is None or self.w8a8_rotation,
            "w8a8_weights",
            "holds the weights of the model turned by w8a8_rotation: set w8a8_rotation (and "
            "quantization='w8a8')",
        )
        _require(
            self.num_threads is None or self.num_threads >= 1,
            "num_threads",
            f"must be >= 1, got {self.num_threads}",
        )
        low, high = SEED_RANGE
        _require(low <= self.seed <= high, "seed", f"must be in [{low}, {high}], got {self.seed}")


@dataclass(frozen=True)
class CacheConfig:
    """Shape and size of the paged KV cache."""

    block_size: int = field(default=16, metadata=_help("tokens per KV block"))
    kv_cache_memory_bytes: int | None = field(
        default=None,
        metadata=_help("bytes for the KV cache; default: sized by kv_cache_memory_fraction (CPU) or "
                       "gpu_memory_utilization (accelerators)"),
    )
    kv_cache_memory_fraction: float = field(
        default=0.1,
        metadata=_help("CPU: fraction of free RAM for the KV cache, in (0, 0.95]"),
    )
    gpu_memory_utilization: float = field(
        default=0.9,
        metadata=_help("accelerators: fraction of the device memory left free by the weights that the KV "
                       "cache takes, in (0, 0.98]; the rest holds activations and CUDA graphs"),
    )

    prefault_kv_cache: bool = field(
        default=False,
        metadata=_help("CPU: write the whole KV cache at start, so no request pays its page faults "
                       "(~30 ms of a 512-token prefill while the cache is new); on for serve"),
    )

    def __post_init__(self) -> None:
        _require(
            1 <= self.block_size <= 1024,
            "block_size",
            f"must be in [1, 1024], got {self.block_size}",
        )
        _require(
            self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes > 0,
            "kv_cache_memory_bytes",
            f"must be > 0, got {self.kv_cache_memory_bytes}",
        )
        _require_in_range(self.kv_cache_memory_fraction, "kv_cache_memory_fraction", 0, 0.95, low_open=True)
        _require_in_range(self.gpu_memory_utilization, "gpu_memory_utilization", 0, 0.98, low_open=True)


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of continuous batching."""

    max_num_seqs: int = field(default=64, metadata=_help("requests running at once"))
    max_num_batched_tokens: int = field(
        default=2048, metadata=_help("tokens one engine step may compute (prefill and decode)")
    )
    max_waiting_requests: int | None = field(
        default=None, metadata=_help("requests allowed to wait; more are refused; default: no limit")
    )
    max_queue_wait_s: float | None = field(
        default=None,
        metadata=_help("seconds a request may wait for its first step; then it ends with an error; "
                       "default: no limit"),
    )
    ttft_slo_ms: float | None = field(
        default=None,
        metadata=_help("TTFT objective in ms (a request's ttft_slo_ms overrides it): prefills are "
                       "served earliest-deadline first and at-risk ones cap the decodes beside them"),
    )
    slo_policy: Literal["best_effort", "refuse"] = field(
        default="best_effort",
        metadata=_help("a request predicted to miss its TTFT objective on arrival: best_effort serves "
                       "it after those that can still make theirs; refuse rejects it at once (429)",
                       choices=("best_effort", "refuse")),
    )

    def __post_init__(self) -> None:
        _require(self.max_num_seqs >= 1, "max_num_seqs", f"must be >= 1, got {self.max_num_seqs}")
        _require(
            self.max_num_batched_tokens >= 1,
            "max_num_batched_tokens",
            f"must be >= 1, got {self.max_num_batched_tokens}",
        )
        _require(
            self.max_waiting_requests is None or self.max_waiting_requests >= 1,
            "max_waiting_requests",
            f"must be >= 1, got {self.max_waiting_requests}",
        )
        _require_in_range(self.max_queue_wait_s, "max_queue_wait_s", 0, MAX_SECONDS, low_open=True)
        _require_in_range(self.ttft_slo_ms, "ttft_slo_ms", 0, MAX_MILLISECONDS, low_open=True)
        _require(
            self.slo_policy in ("best_effort", "refuse"),
            "slo_policy",
            f"must be 'best_effort' or 'refuse', got {self.slo_policy!r}",
        )


@dataclass(frozen=True)
class ChunkedPrefillConfig:
    """How a long prompt is split over steps so that it never blocks other requests."""

    enable: bool = field(default=True, metadata=_help("split long prefills into chunks"))
    chunk_size: Union[int, Literal["auto"]] = field(
        default="auto",
        metadata=_help("prefill tokens per step: an int, or auto (chosen from load and a cost model)"),
    )
    max_stall_factor: float = field(
        default=20.0,
        metadata=_help(
            "auto: the longest a step with prefill tokens may take, as a multiple of this machine's "
            "step of the running decodes alone (of one decode when none run): it bounds how long "
            "streams stall and how long a new prompt waits for the step in flight; a cut prompt's "
            "first token comes at most 1/factor later"
        ),
    )
    itl_target_ms: float | None = field(
        default=None,
        metadata=_help("auto: an absolute bound on a step with prefill tokens as well, in ms; default: none"),
    )
    # Below ~128 tokens a chunk's step costs about as much as its weights' read: smaller chunks
    # stretch a long prompt's prefill over many steps and starve the queue behind it.
    min_chunk_size: int = field(
        default=128, metadata=_help("smallest prefill budget auto picks while decodes run, in tokens")
    )
    aging_steps: int = field(
        default=32,
        metadata=_help("steps after which a waiting prefill goes before shorter ones (no starvation)"),
    )

    def __post_init__(self) -> None:
        _require(
            self.chunk_size == "auto" or (isinstance(self.chunk_size, int) and self.chunk_size >= 1),
            "chunk_size",
            f"must be 'auto' or an int >= 1, got {self.chunk_size!r}",
        )
        _require_in_range(self.max_stall_factor, "max_stall_factor", 1, MAX_STALL_FACTOR)
        _require_in_range(self.itl_target_ms, "itl_target_ms", 0, MAX_MILLISECONDS, low_open=True)
        _require(
            self.min_chunk_size >= 1, "min_chunk_size", f"must be >= 1, got {self.min_chunk_size}"
        )
        _require(self.aging_steps >= 1, "aging_steps", f"must be >= 1, got {self.aging_steps}")


@dataclass(frozen=True)
class PromptCacheConfig:
    """Cross-request reuse of the KV of shared prefixes."""

    enable: bool = field(default=True, metadata=_help("reuse the KV of prefixes seen before"))
    persist_dir: str | None = field(
        default=None,
        metadata=_help("folder where pinned prefixes' KV is saved and restored across restarts"),
    )
    max_pinned_fraction: float = field(
        default=0.5,
        metadata=_help(
            "fraction of the KV blocks that pinned prefixes may hold together; a pin past it is refused"
        ),
    )

    def __post_init__(self) -> None:
        _require_in_range(self.max_pinned_fraction, "max_pinned_fraction", 0, 1)


@dataclass(frozen=True)
class AttentionConfig:
    """Which attention implementation runs."""

    backend: str = field(
        default="auto",
        metadata=_help("attention backend: auto (sdpa on cpu, triton on cuda) | sdpa | triton",
                       choices=ATTENTION_BACKENDS),
    )

    def __post_init__(self) -> None:
        _require(self.backend in ATTENTION_BACKENDS, "backend", f"unknown backend {self.backend!r}")


@dataclass(frozen=True)
class StreamingLLMConfig:
    """StreamingLLM (attention sinks plus a window): a flat cost per token however long a
    conversation grows, at the price of outputs that change once it passes the window."""

    window: int | None = field(
        default=None,
        metadata=_help("StreamingLLM: each query sees the last N tokens and the sinks (approximate once a "
                       "sequence is longer: outputs change); unset: off"),
    )
    sink_tokens: int = field(
        default=4,
        metadata=_help("StreamingLLM: the first tokens every query keeps seeing (1..64)"),
    )

    def __post_init__(self) -> None:
        _require(
            self.window is None or self.window >= 1,
            "streaming_window",
            f"must be >= 1 (tokens), got {self.window}",
        )
        _require(
            1 <= self.sink_tokens <= 64,
            "streaming_sink_tokens",
            f"must be in [1, 64], got {self.sink_tokens}",
        )


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: tokens proposed cheaply, verified by the model in one step."""

    method: str | None = field(
        default=None,
        metadata=_help("proposer: ngram (prompt lookup: the tokens that followed the latest earlier "
                       "match of the last n tokens) | draft (a smaller model's greedy tokens); unset: off",
                       choices=SPECULATIVE_METHODS),
    )
    model: str | None = field(
        default=None,
        metadata=_help(
            "draft: the draft model (GGUF file or Hugging Face folder) sharing the target's tokenizer"
        ),
    )
    draft_kv_cache_memory_bytes: int = field(
        default=64 << 20, metadata=_help("draft: bytes for the draft model's own paged KV cache")
    )
    num_speculative_tokens: int = field(default=4, metadata=_help("tokens proposed per sequence and step"))
    prompt_lookup_max: int = field(default=4, metadata=_help("ngram: longest suffix matched, in tokens"))
    prompt_lookup_min: int = field(default=2, metadata=_help("ngram: shortest suffix matched, in tokens"))
    # Verifying k tokens costs about one decode while a step is bound by reading the weights;
    # with many sequences it is bound by compute and rejected proposals cost real time.
    max_num_speculating_seqs: int = field(
        default=8, metadata=_help("speculate only in steps of at most this many decoding sequences")
    )

    def __post_init__(self) -> None:
        _require(
            self.method is None or self.method in SPECULATIVE_METHODS,
            "method",
            f"must be one of {SPECULATIVE_METHODS} or unset, got {self.method!r}",
        )
        _require(
            (self.method == "draft") == (self.model is not None),
            "model",
            "is the draft model: set it with method draft, and only then",
        )
        _require(
            self.draft_kv_cache_memory_bytes > 0,
            "draft_kv_cache_memory_bytes",
            f"must be > 0, got {self.draft_kv_cache_memory_bytes}",
        )
        _require(
            1 <= self.num_speculative_tokens <= 16,
            "num_speculative_tokens",
            f"must be in [1, 16], got {self.num_speculative_tokens}",
        )
        _require(
            1 <= self.prompt_lookup_min <= self.prompt_lookup_max,
            "prompt_lookup_min",
            f"must be in [1, prompt_lookup_max ({self.prompt_lookup_max})], got {self.prompt_lookup_min}",
        )
        _require(
            self.max_num_speculating_seqs >= 1,
            "max_num_speculating_seqs",
            f"must be >= 1, got {self.max_num_speculating_seqs}",
        )


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism: how many processes share each layer's weights, and how they talk."""

    tensor_parallel_size: int = field(
        default=1,
        metadata=_help("processes (ranks) that each hold a slice of every layer and of the KV cache; "
                       "1: one process, no process group"),
    )
    distributed_backend: str = field(
        default="auto",
        metadata=_help("torch.distributed backend of the ranks: auto (gloo on cpu, nccl on cuda) or a "
                       "backend name passed through (e.g. hccl)"),
    )
    distributed_timeout_s: float = field(
        default=60.0,
        metadata=_help("seconds a collective may wait for a rank before the engine fails with an error"),
    )

    def __post_init__(self) -> None:
        _require(
            self.tensor_parallel_size >= 1,
            "tensor_parallel_size",
            f"must be >= 1, got {self.tensor_parallel_size}",
        )
        _require(bool(self.distributed_backend), "distributed_backend", "must not be empty")
        _require_in_range(self.distributed_timeout_s, "distributed_timeout_s", 0, MAX_SECONDS, low_open=True)


SUBCONFIGS: dict[str, type] = {
    "model_config": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "chunked_prefill": ChunkedPrefillConfig,
    "prompt_cache": PromptCacheConfig,
    "attention": AttentionConfig,
    "speculative_config": SpeculativeConfig,
    "parallel": ParallelConfig,
    "streaming_llm": StreamingLLMConfig,
}

# Flat keyword names that would be ambiguous across subsystems get a prefix.
_FLAT_ALIASES: dict[tuple[str, str], str] = {
    ("chunked_prefill", "enable"): "enable_chunked_prefill",
    ("prompt_cache", "enable"): "enable_prompt_cache",
    ("prompt_cache", "persist_dir"): "prompt_cache_dir",
    ("attention", "backend"): "attention_backend",
    ("speculative_config", "method"): "speculative_method",
    ("speculative_config", "model"): "speculative_model",
    ("streaming_llm", "window"): "streaming_window",
    ("streaming_llm", "sink_tokens"): "streaming_sink_tokens",
}


def flat_name(section: str, field_name: str) -> str:
    """The keyword / CLI name of one config field."""
    return _FLAT_ALIASES.get((section, field_name), field_name)


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to start, one frozen record per subsystem."""

    model_config: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    chunked_prefill: ChunkedPrefillConfig = field(default_factory=ChunkedPrefillConfig)
    prompt_cache: PromptCacheConfig = field(default_factory=PromptCacheConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    speculative_config: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    streaming_llm: StreamingLLMConfig = field(default_factory=StreamingLLMConfig)

    def __post_init__(self) -> None:
        _require(
            self.scheduler.slo_policy != "refuse" or self.predicts_ttft,
            "slo_policy",
            "'refuse' refuses a request predicted to miss its TTFT objective, and with neither "
            "ttft_slo_ms nor chunk_size 'auto' (with chunked prefill) nothing is predicted: set "
            "ttft_slo_ms, or keep chunk_size 'auto' so that requests' own ttft_slo_ms are predicted",
        )
        if self.parallel.tensor_parallel_size > 1:
            self._check_splits_over_ranks()

    @property
    def predicts_ttft(self) -> bool:
        """Whether requests' TTFTs are predicted (from the cost model that auto's chunks use too)."""
        chunked = self.chunked_prefill
        return (chunked.enable and chunked.chunk_size == "auto") or self.scheduler.ttft_slo_ms is not None

    def _check_splits_over_ranks(self) -> None:
        """What tensor parallelism cannot hold: each rank has a slice of the KV and of each
        projection's inputs."""
        _require(
            self.prompt_cache.persist_dir is None or not self.prompt_cache.enable,
            "prompt_cache_dir",
            "persisted pinned prefixes need tensor_parallel_size 1 (each rank holds a KV slice)",
        )
        _require(
            self.model_config.w8a8_activation_stats is None,
            "w8a8_activation_stats",
            "maxima are for a whole model, not with tensor_parallel_size > 1",
        )
        _require(
            not self.model_config.w8a8_rotation,
            "w8a8_rotation",
            "each rank would hold part of each rotation's inputs: tensor_parallel_size 1 only",
        )

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Build from flat keywords (`block_size=32`) and/or whole sections (`cache=CacheConfig()`,
        or its fields as a dict: `speculative_config={"method": "ngram"}`).

        Unknown keywords raise a ValueError naming them, so a typo is never silently ignored.
        """
        sections: dict[str, Any] = {}
        for section in SUBCONFIGS:
            value = kwargs.pop(section, None)  # None: the section's defaults
            if value is not None:
                sections[section] = value
        per_section: dict[str, dict[str, Any]] = {section: {} for section in SUBCONFIGS}
        for section, section_cls in SUBCONFIGS.items():
            for config_field in dataclasses.fields(section_cls):
                name = flat_name(section, config_field.name)
                if name in kwargs:
                    per_section[section][config_field.name] = kwargs.pop(name)
        if kwargs:
            raise ValueError(f"unknown engine option(s): {', '.join(sorted(kwargs))}")
        built: dict[str, Any] = {}
        for section, section_cls in SUBCONFIGS.items():
            if section not in sections:
                # Built from the given fields alone: a default left unused (an environment
                # variable's, such as $FIRSTTOKEN_ISA beside cpu_isa=) is never read.
                built[section] = section_cls(**per_section[section])
                continue
            base = sections[section]
            if isinstance(base, dict):
                base = _section_from_dict(section, section_cls, base)
            if not isinstance(base, section_cls):
                raise InvalidInputError(
                    section, f"expected {section_cls.__name__}, got {type(base).__name__}"
                )
            built[section] = dataclasses.replace(base, **per_section[section])
        return cls(**built)


def _section_from_dict(section: str, section_cls: type, values: dict[str, Any]) -> Any:
    known = {config_field.name for config_field in dataclasses.fields(section_cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise InvalidInputError(
            section, f"unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
        )
    hints = typing.get_type_hints(section_cls)
    for name, value in values.items():
        if not _has_type(value, hints[name]):
            expected = _type_name(hints[name])
            got = f"{type(value).__name__} {value!r}"
            raise InvalidInputError(f"{section}.{name}", f"expected {expected}, got {got}")
    return section_cls(**values)


def _has_type(value: Any, hint: Any) -> bool:
    """Whether `value` is of a config field's type (JSON gives `"4"` where 4 was meant)."""
    if typing.get_origin(hint) in (Union, types.UnionType):
        return any(_has_type(value, option) for option in typing.get_args(hint))
    if typing.get_origin(hint) is Literal:
        return value in typing.get_args(hint)
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def _type_name(hint: Any) -> str:
    if typing.get_origin(hint) in (Union, types.UnionType):
        return " or ".join(_type_name(option) for option in typing.get_args(hint))
    if typing.get_origin(hint) is Literal:
        return " or ".join(repr(option) for option in typing.get_args(hint))
    return "null" if hint is type(None) else hint.__name__
