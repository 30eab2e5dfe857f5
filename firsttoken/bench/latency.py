"""`firsttoken bench latency`: TTFT, TPOT, end-to-end time and token rates of one batch, offline.

Each run sends `batch_size` fresh prompts of exactly `input_len` tokens (tokenized by the
engine, so tokenization counts) and generates `output_len` tokens each, greedily and past EOS.
Medians over the timed runs, after warm-up runs.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, fields

from firsttoken.bench.datasets import TextSource
from firsttoken.bench.table import format_table
from firsttoken.engine.llm import LLM
from firsttoken.progress import progress_bar
from firsttoken.sampling_params import SamplingParams


@dataclass(frozen=True)
class LatencySpec:
    """The batch shape and how many runs to time."""

    input_len: int = 512
    output_len: int = 128
    batch_size: int = 1
    runs: int = 5
    warmup_runs: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("input_len", "output_len", "batch_size", "runs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.warmup_runs < 0:
            raise ValueError(f"warmup_runs: must be >= 0, got {self.warmup_runs}")


@dataclass(frozen=True)
class LatencyRun:
    """One timed batch.

    ttft_s and tpot_s are means over the batch's requests; e2e_s is the batch's wall time.
    Prefill rate: prompt tokens computed / (first scheduled -> last first token). Decode rate:
    tokens after each request's first / (first first token -> last token).
    """

    ttft_s: float
    tpot_s: float | None
    e2e_s: float
    prefill_tokens_per_s: float
    decode_tokens_per_s: float | None


def time_batch(llm: LLM, prompts: list[str], params: SamplingParams) -> LatencyRun:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    e2e = time.perf_counter() - start
    metrics = [output.metrics for output in outputs]
    first_tokens_done = max(m.first_token_time for m in metrics)
    prefill_window = first_tokens_done - min(m.first_scheduled_time for m in metrics)
    decode_window = max(m.last_token_time for m in metrics) - min(m.first_token_time for m in metrics)
    num_decode_tokens = sum(m.num_generation_tokens - 1 for m in metrics)
    tpots = [m.decode_s / (m.num_generation_tokens - 1) for m in metrics if m.num_generation_tokens > 1]
    return LatencyRun(
        ttft_s=statistics.fmean(m.ttft_s for m in metrics),
        tpot_s=statistics.fmean(tpots) if tpots else None,
        e2e_s=e2e,
        prefill_tokens_per_s=sum(m.num_prompt_tokens - m.num_cached_tokens for m in metrics) / prefill_window,
        decode_tokens_per_s=num_decode_tokens / decode_window if num_decode_tokens else None,
    )


def measure_latency(llm: LLM, spec: LatencySpec, show_progress: bool = False) -> list[LatencyRun]:
    """The timed runs (warm-up runs are discarded), each on prompts no earlier run has seen."""
    source = TextSource(llm.tokenizer, spec.seed)
    params = SamplingParams(temperature=0, max_tokens=spec.output_len, ignore_eos=True)
    runs = []
    num_batches = spec.warmup_runs + spec.runs
    description = f"batches ({spec.warmup_runs} warm-up)"
    with progress_bar(num_batches, description, "batch", show_progress) as bar:
        for index in range(num_batches):
            prompts = [source.text(spec.input_len) for _ in range(spec.batch_size)]
            run = time_batch(llm, prompts, params)
            if index >= spec.warmup_runs:
                runs.append(run)
            bar.update()
    return runs


def median_run(runs: list[LatencyRun]) -> dict[str, float | None]:
    """Each field's median over the runs (None where no run had a value: one output token)."""
    medians: dict[str, float | None] = {}
    for field in fields(LatencyRun):
        values = [getattr(run, field.name) for run in runs if getattr(run, field.name) is not None]
        medians[field.name] = statistics.median(values) if values else None
    return medians


_ROWS = (
    ("TTFT (ms)", "ttft_s", 1000.0),
    ("TPOT (ms)", "tpot_s", 1000.0),
    ("end-to-end (ms)", "e2e_s", 1000.0),
    ("prefill (tokens/s)", "prefill_tokens_per_s", 1.0),
    ("decode (tokens/s)", "decode_tokens_per_s", 1.0),
)


def format_report(runs: list[LatencyRun], spec: LatencySpec) -> str:
    medians = median_run(runs)
    rows = []
    for label, name, scale in _ROWS:
        values = [getattr(run, name) * scale for run in runs if getattr(run, name) is not None]
        if values:
            rows.append([label, medians[name] * scale, min(values), max(values)])
        else:
            rows.append([label, "-", "-", "-"])
    header = (
        f"batch {spec.batch_size} x {spec.input_len} prompt tokens -> {spec.output_len} output tokens, "
        f"median of {len(runs)} runs after {spec.warmup_runs} warm-up"
    )
    return header + "\n\n" + format_table(["", "median", "min", "max"], rows)


def format_json(runs: list[LatencyRun], spec: LatencySpec) -> str:
    return json.dumps(
        {"spec": asdict(spec), "median": median_run(runs), "runs": [asdict(run) for run in runs]}
    )
