"""What the engine gives back: a request's streamed deltas, its accumulated RequestOutput and
its timing (RequestMetrics), pinned prefixes, and snapshots of the engine's counters."""

from __future__ import annotations

from dataclasses import dataclass, field

# TokenLogprob is re-exported: outputs carry it inside SampledToken.
from firsttoken.logprobs import SampledToken, TokenLogprob  # noqa: F401
from firsttoken.request import RequestTimestamps


@dataclass(frozen=True)
class RequestMetrics:
    """Timestamps (perf_counter seconds) and durations (seconds) of one request.

    tokenize + queue + prefill = ttft: arrival -> tokenized -> first scheduled -> first token.
    """

    arrival_time: float
    tokenized_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    last_token_time: float | None
    finished_time: float | None
    num_prompt_tokens: int
    num_generation_tokens: int
    num_cached_tokens: int
    num_prefill_chunks: int
    num_preemptions: int
    # Its TTFT objective and the TTFT the scheduler predicted on arrival, in seconds (None: none).
    ttft_slo_s: float | None = None
    predicted_ttft_s: float | None = None

    @property
    def tokenize_s(self) -> float:
        return self.tokenized_time - self.arrival_time

    @property
    def queue_s(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.tokenized_time

    @property
    def prefill_s(self) -> float | None:
        if self.first_token_time is None or self.first_scheduled_time is None:
            return None
        return self.first_token_time - self.first_scheduled_time

    @property
    def ttft_s(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def decode_s(self) -> float | None:
        if self.first_token_time is None or self.last_token_time is None:
            return None
        return self.last_token_time - self.first_token_time

    @property
    def e2e_s(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time

    @property
    def prefill_tokens_per_s(self) -> float | None:
        prefill = self.prefill_s
        computed = self.num_prompt_tokens - self.num_cached_tokens
        return computed / prefill if prefill else None

    @property
    def decode_tokens_per_s(self) -> float | None:
        decode = self.decode_s
        return (self.num_generation_tokens - 1) / decode if decode else None

    @classmethod
    def from_timestamps(
        cls,
        timestamps: RequestTimestamps,
        num_prompt_tokens: int,
        num_generation_tokens: int,
        num_cached_tokens: int,
        num_preemptions: int,
        ttft_slo_s: float | None = None,
        predicted_ttft_s: float | None = None,
    ) -> RequestMetrics:
        return cls(
            arrival_time=timestamps.arrival,
            tokenized_time=timestamps.tokenized if timestamps.tokenized is not None else timestamps.arrival,
            first_scheduled_time=timestamps.first_scheduled,
            first_token_time=timestamps.first_token,
            last_token_time=timestamps.last_token,
            finished_time=timestamps.finished,
            num_prompt_tokens=num_prompt_tokens,
            num_generation_tokens=num_generation_tokens,
            num_cached_tokens=num_cached_tokens,
            num_prefill_chunks=len(timestamps.prefill_chunk_ends),
            num_preemptions=num_preemptions,
            ttft_slo_s=ttft_slo_s,
            predicted_ttft_s=predicted_ttft_s,
        )


@dataclass
class RequestDelta:
    """New tokens and text of one request since its previous delta."""

    req_id: str
    token_ids: list[int]
    text: str
    logprobs: list[SampledToken] | None
    finished: bool
    finish_reason: str | None
    stop_reason: int | str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    metrics: RequestMetrics
    # With the first token, when prompt_logprobs was asked: one entry per prompt token, the
    # first None (nothing comes before it).
    prompt_logprobs: list[SampledToken | None] | None = None


@dataclass
class RequestOutput:
    """A request's whole result (`LLM.generate`)."""

    req_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[SampledToken] | None = None
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    prompt_logprobs: list[SampledToken | None] | None = None  # see RequestDelta

    def add(self, delta: RequestDelta) -> None:
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        self.token_ids.extend(delta.token_ids)
        self.text += delta.text
        if delta.logprobs is not None:
            self.logprobs = (self.logprobs or []) + delta.logprobs
        self.finished = delta.finished
        self.finish_reason = delta.finish_reason
        self.stop_reason = delta.stop_reason
        self.num_cached_tokens = delta.num_cached_tokens
        self.metrics = delta.metrics


@dataclass(frozen=True)
class PinnedPrefix:
    """A prefix whose KV stays resident: its id and the tokens its full blocks hold."""

    pin_id: str
    token_ids: list[int]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class EngineCompute:
    """How the engine computes, as chosen at start: its dtype, whether it holds batch invariance
    (a request's tokens the same bits whatever runs beside it), and the start-up log's lines on
    why (dtype, invariance, chunking), with the measured figures behind each."""

    dtype: str
    batch_invariant: bool
    start_up_choices: tuple[str, ...]


@dataclass(frozen=True)
class GraphCaptureReport:
    """What capturing the graphs cost at start-up."""

    batch_sizes: tuple[int, ...]  # decode-only steps
    token_sizes: tuple[int, ...]  # steps with prefill rows; empty when they run eagerly
    seconds: float
    device_memory_bytes: int  # taken on the device by the graphs' pool and static inputs; 0 on a CPU


# The whole-step native forwards, by the names EngineInspection.whole_step_forwards gives them.
WHOLE_STEP_INT4_DECODE = "int4 decode"
WHOLE_STEP_W8A8 = "w8a8"


@dataclass(frozen=True)
class EngineInspection:
    """What an engine was built with, for tools and tests to read instead of its internals: the
    model, the kernels chosen at start and the KV cache. Every tensor-parallel rank runs the same
    choices on its shard of each projection, so one description speaks for all of them."""

    model_path: str
    architecture: str
    num_layers: int
    vocab_size: int
    max_model_len: int
    device: str
    dtype: str
    batch_invariant: bool
    # How the projections run: "int4", "int8", "w8a8" or None (float projections); and how the
    # checkpoint's files hold them (a W8A8 checkpoint runs dequantized where int8 sums are not exact).
    quantization: str | None
    checkpoint_quantization: str | None
    # The ISA the native CPU kernels were built for; None where torch ops run (or on a GPU).
    native_isa: str | None
    # The whole-step native forwards the runner holds ("int4 decode", "w8a8"), else empty, and
    # why none can run this model at all (None where the weights' form decides).
    whole_step_forwards: tuple[str, ...]
    whole_step_unsupported_reason: str | None
    num_threads: int
    tensor_parallel_size: int
    num_kv_blocks: int
    block_size: int
    # What makes the KV of a token sequence this engine's (part of every prefix hash).
    kv_identity: str
    # The CUDA graphs captured at start, and what they cost; None where steps run eagerly.
    graph_capture: GraphCaptureReport | None
    # The start-up log's line on the engine, and its lines on each measured choice.
    description: str
    start_up_choices: tuple[str, ...]


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
    num_pinned_tokens: int
    # Requests refused on arrival as predicted to miss their TTFT objective, and decodes that sat
    # out a step so that a prefill at risk of missing its objective could make it.
    num_slo_refusals: int = 0
    num_deferred_decodes: int = 0
    # Speculative decoding: decodes that carried proposals, proposals, accepted proposals, and
    # accepted proposals by position (the first, the second, ...).
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_accepted_per_position: tuple[int, ...] = ()

    @property
    def spec_decode_acceptance_rate(self) -> float | None:
        """Accepted / proposed tokens; None before any proposal."""
        if not self.spec_decode_num_draft_tokens:
            return None
        return self.spec_decode_num_accepted_tokens / self.spec_decode_num_draft_tokens
