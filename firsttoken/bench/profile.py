"""`firsttoken profile`: TTFT statistics and a measured per-stage breakdown of one request.

TTFT here is what a caller of the engine waits for: from the request's arrival (before
tokenization) to holding its first delta, detokenized. Plain runs (no hooks) give the TTFT
statistics; instrumented runs, interleaved with them so both see the same machine state,
give the stages. The stage medians should add up to the plain TTFT median: what they miss
is the cost of the instrumentation itself.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from firsttoken.bench.datasets import TextSource
from firsttoken.bench.stage_hooks import (
    STAGE_LABELS,
    STAGES,
    EngineParts,
    StageClock,
    find_engine_parts,
    instrumented,
    stage_seconds,
)
from firsttoken.bench.stats import Distribution, summarize
from firsttoken.bench.table import format_table
from firsttoken.core.policy import PrefillPlan, plan_prefill
from firsttoken.engine.llm import LLM
from firsttoken.outputs import WHOLE_STEP_W8A8, RequestMetrics
from firsttoken.progress import progress_bar
from firsttoken.sampling_params import SamplingParams

FIRST_TOKEN_ONLY = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


@dataclass(frozen=True)
class ProfileSpec:
    """What a profile measures: the prompt length, how many runs, and an optional trace file."""

    input_len: int = 512
    runs: int = 10
    warmup_runs: int = 1
    seed: int = 0
    trace_path: str | None = None

    def __post_init__(self) -> None:
        if self.input_len < 1:
            raise ValueError(f"input_len: must be >= 1, got {self.input_len}")
        if self.runs < 1:
            raise ValueError(f"runs: must be >= 1, got {self.runs}")
        if self.warmup_runs < 0:
            raise ValueError(f"warmup_runs: must be >= 0, got {self.warmup_runs}")


# Loads the chunk plan is shown at: decoding streams beside the profiled prompt.
PLAN_DECODE_COUNTS = (0, 1, 4, 8, 16, 32, 64)


@dataclass(frozen=True)
class ProfileResult:
    """TTFT of the plain runs and the stage breakdown of the instrumented ones, in seconds;
    with `chunk_size="auto"`, the chunks it would cut the prompt into under several loads."""

    num_prompt_tokens: int
    ttft: Distribution
    instrumented_ttft: Distribution
    stage_runs: list[dict[str, float]] = field(repr=False)
    chunk_plans: dict[int, PrefillPlan] = field(default_factory=dict)
    # The model, dtype, device and the ISA the native kernels were built for.
    engine_description: str = ""
    # The start-up log's lines on the dtype, batch invariance and chunking chosen, and why.
    start_up_choices: tuple[str, ...] = ()

    @property
    def stage_medians(self) -> dict[str, float]:
        return {stage: statistics.median(run[stage] for run in self.stage_runs) for stage in STAGES}

    @property
    def stages_sum(self) -> float:
        return sum(self.stage_medians.values())

    @property
    def stages_add_up(self) -> bool:
        """Whether the stage medians are within 10% of the plain TTFT median: the hooks cost
        less than that, so a larger gap means the runs saw different machine states."""
        return abs(self.stages_sum - self.ttft.median) <= 0.10 * self.ttft.median

    def to_json_dict(self) -> dict[str, Any]:
        return {
            "engine": self.engine_description,
            "start_up_choices": list(self.start_up_choices),
            "num_prompt_tokens": self.num_prompt_tokens,
            "runs": self.ttft.count,
            "ttft_ms": self.ttft.median * 1000,
            "ttft_stats_ms": self.ttft.scaled(1000).to_dict(),
            "instrumented_ttft_ms": self.instrumented_ttft.median * 1000,
            "stages_ms": {stage: seconds * 1000 for stage, seconds in self.stage_medians.items()},
            "stages_sum_ms": self.stages_sum * 1000,
            "stages_add_up": self.stages_add_up,
            "auto_chunk_plans": {
                str(num_decodes): {
                    "chunk_tokens": plan.chunk_tokens,
                    "step_ms": [seconds * 1000 for seconds in plan.step_seconds],
                }
                for num_decodes, plan in self.chunk_plans.items()
            },
        }


@dataclass(frozen=True)
class FirstToken:
    """When one request's first delta was in hand, and the engine's timestamps of it."""

    ttft_s: float
    metrics: RequestMetrics


def first_token(llm: LLM, prompt: str) -> FirstToken:
    """Send `prompt` and wait for its first delta; TTFT runs from the engine's arrival stamp."""
    stream = llm.stream(prompt, FIRST_TOKEN_ONLY)
    delta = next(stream)
    received = time.perf_counter()
    stream.close()
    return FirstToken(received - delta.metrics.arrival_time, delta.metrics)


def profile_ttft(llm: LLM, spec: ProfileSpec, show_progress: bool = False) -> ProfileResult:
    """Plain and instrumented runs, interleaved, on fresh prompts of `spec.input_len` tokens,
    all on the model's forward (see `EngineCore.forward_op_by_op`)."""
    with llm.core.forward_op_by_op() as set_aside:
        result = _profile_runs(llm, spec, show_progress)
    # Only the W8A8 one takes prompts: the int4 one runs decode steps, which a first token has none of.
    if WHOLE_STEP_W8A8 in set_aside:
        description = f"{result.engine_description}; {WHOLE_STEP_SET_ASIDE}"
        result = dataclasses.replace(result, engine_description=description)
    return result


# What the report says where the runner's whole-step forward was set aside.
WHOLE_STEP_SET_ASIDE = (
    "timed on the model's forward op by op (the engine runs its steps in one native call, faster)"
)


def _profile_runs(llm: LLM, spec: ProfileSpec, show_progress: bool) -> ProfileResult:
    parts = find_engine_parts(llm.core)
    source = TextSource(llm.tokenizer, spec.seed)
    plain: list[FirstToken] = []
    stage_runs: list[dict[str, float]] = []
    instrumented_ttfts: list[float] = []
    # A run is a plain and an instrumented first token.
    description = f"runs ({spec.warmup_runs} warm-up)"
    with progress_bar(spec.warmup_runs + spec.runs, description, "run", show_progress) as bar:
        for _ in range(spec.warmup_runs):
            first_token(llm, source.text(spec.input_len))
            _instrumented_run(llm, parts, source.text(spec.input_len))
            bar.update()
        for _ in range(spec.runs):
            plain.append(first_token(llm, source.text(spec.input_len)))
            ttft_s, stages = _instrumented_run(llm, parts, source.text(spec.input_len))
            instrumented_ttfts.append(ttft_s)
            stage_runs.append(stages)
            bar.update()
    if spec.trace_path is not None:
        write_trace(llm, parts, source.text(spec.input_len), spec.trace_path)
    return ProfileResult(
        num_prompt_tokens=plain[0].metrics.num_prompt_tokens,
        ttft=summarize([run.ttft_s for run in plain]),
        instrumented_ttft=summarize(instrumented_ttfts),
        stage_runs=stage_runs,
        chunk_plans=auto_chunk_plans(llm, plain[0].metrics.num_prompt_tokens),
        engine_description=llm.inspect().description,
        start_up_choices=llm.compute.start_up_choices,
    )


def auto_chunk_plans(llm: LLM, prompt_tokens: int) -> dict[int, PrefillPlan]:
    """By number of decoding streams (each with a prompt as long as this one), the chunks
    `chunk_size="auto"` cuts the prompt into, as the engine's cost model now predicts them;
    empty when chunk sizes are fixed."""
    scheduler = llm.core.scheduler
    if scheduler.step_times is None:
        return {}
    max_decodes = llm.core.config.scheduler.max_num_seqs - 1
    return {
        num_decodes: plan_prefill(
            prompt_tokens,
            num_decodes,
            prompt_tokens,
            scheduler.step_times.model,
            scheduler.prefill_planner.latency_targets,
        )
        for num_decodes in PLAN_DECODE_COUNTS
        if num_decodes <= max_decodes
    }


def _instrumented_run(
    llm: LLM, parts: EngineParts, prompt: str, trace: bool = False
) -> tuple[float, dict[str, float]]:
    with instrumented(parts, StageClock(torch.device(llm.inspect().device), trace)) as clock:
        result = first_token(llm, prompt)
    return result.ttft_s, stage_seconds(parts, clock, result.ttft_s, result.metrics)


def write_trace(llm: LLM, parts: EngineParts, prompt: str, path: str) -> None:
    """A Chrome trace (chrome://tracing, Perfetto) of one instrumented request, with a scope per stage."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.device(llm.inspect().device).type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with (
        torch.profiler.profile(activities=activities, record_shapes=True) as profiler,
        torch.profiler.record_function("ttft"),
    ):
        _instrumented_run(llm, parts, prompt, trace=True)
    profiler.export_chrome_trace(path)


def format_report(result: ProfileResult, input_len: int) -> str:
    ttft_ms = result.ttft.scaled(1000)
    medians = result.stage_medians
    rows = [
        [STAGE_LABELS[stage], seconds * 1000, f"{100 * seconds / result.ttft.median:.1f}%"]
        for stage, seconds in medians.items()
    ]
    rows.append(
        ["sum of stages", result.stages_sum * 1000, f"{100 * result.stages_sum / result.ttft.median:.1f}%"]
    )
    header = (
        f"TTFT over {ttft_ms.count} runs, {result.num_prompt_tokens} prompt tokens "
        f"(--input-len {input_len}): "
        f"median {ttft_ms.median:.2f} ms, P90 {ttft_ms.p90:.2f}, P99 {ttft_ms.p99:.2f}, "
        f"min {ttft_ms.min:.2f}, max {ttft_ms.max:.2f}"
    )
    table = format_table(["stage (median of instrumented runs)", "ms", "of TTFT"], rows)
    choices = "".join(f"\n  {choice}" for choice in result.start_up_choices)
    report = f"engine: {result.engine_description}{choices}\n{header}\n\n{table}"
    if result.chunk_plans:
        report += "\n\n" + format_chunk_plans(result.chunk_plans, result.num_prompt_tokens)
    if not result.stages_add_up:
        report += (
            f"\n\nThe stages add up to {result.stages_sum * 1000:.2f} ms, more than 10% away from the TTFT: "
            "something else used this machine's CPU during some runs. Rerun, or add --runs."
        )
    return report


def format_chunk_plans(plans: dict[int, PrefillPlan], prompt_tokens: int) -> str:
    rows = [
        [
            num_decodes,
            " + ".join(str(tokens) for tokens in plan.chunk_tokens),
            max(plan.step_seconds) * 1000,
            plan.prefill_seconds * 1000,
        ]
        for num_decodes, plan in plans.items()
    ]
    title = (
        f"chunk_size auto: the chunks of this {prompt_tokens}-token prompt while streams of as many tokens "
        "decode beside it (predicted by the measured step costs; a step with a chunk takes at most "
        "--max-stall-factor times the decodes' own step, so the streams' stalls are bounded while each "
        "cut costs the prompt one decode step)"
    )
    table = format_table(["decoding streams", "chunks (tokens)", "longest step ms", "prefill ms"], rows)
    return f"{title}\n{table}"


def format_json(result: ProfileResult, input_len: int) -> str:
    return json.dumps({"input_len": input_len, **result.to_json_dict()})
