"""Measures this device's step cost at start-up and fits the scheduler's StepCostModel.

Synthetic steps (prefill chunks of several sizes, a chunk after cached context, a batch of
decodes) run on scratch KV blocks before any request exists. The fitted model is cached per
model, dtype, device and thread count, so later starts skip the measurement; a cached model
must still predict one fresh probe step within a factor of two, or it is measured again (a
calibration taken while the machine was busy would otherwise mislead every later start).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Protocol

import numpy as np

from firsttoken.arithmetic import ceil_div
from firsttoken.core.batch import ModelOutput, SampleSpec, ScheduledChunk, SchedulerOutput
from firsttoken.core.cost_model import StepCostModel, step_work
from firsttoken.sampling_params import SamplingParams
from firsttoken.worker.cpu_contention import measured_for_cache

logger = logging.getLogger(__name__)

CALIBRATION_VERSION = 3
# A cached model whose prediction of the probe step is off by more than this factor is refitted.
PROBE_TOLERANCE = 2.0
# A step of at least this many tokens is timed once: its one-time costs (a new shape's kernel
# set-up, fresh pages) are a small part of it, and the largest steps are most of a calibration.
SINGLE_RUN_TOKENS = 512
_GREEDY_ONE = SamplingParams(temperature=0, max_tokens=1)
# Rows of the calibration's decode batches: a batch as a served load runs.
DECODE_ROWS = 16


class StepRunner(Protocol):
    """What runs a step on every rank of the engine (the executor)."""

    def execute(self, scheduler_output: SchedulerOutput) -> ModelOutput: ...


@dataclass(frozen=True)
class CalibrationLimits:
    """What bounds the synthetic steps: the scratch blocks, the step and context sizes, the
    token ids."""

    block_size: int
    num_blocks: int
    max_batched_tokens: int
    max_model_len: int
    vocab_size: int

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size


@dataclass(frozen=True)
class ChunkAt:
    """One sequence's part of a synthetic step."""

    start_position: int
    num_tokens: int


@dataclass(frozen=True)
class StepShape:
    """A synthetic step: (start position, token count) of each of its sequences."""

    chunks: tuple[tuple[int, int], ...]

    @property
    def num_tokens(self) -> int:
        return sum(count for _, count in self.chunks)

    @property
    def work(self) -> tuple[int, int, int, int]:
        """Its prefill tokens and pairs, its decode rows and their pairs (cost_model.step_work)."""
        return step_work(ChunkAt(start, count) for start, count in self.chunks)


def calibration_shapes(limits: CalibrationLimits) -> list[StepShape]:
    """Steps spanning the sizes the scheduler chooses between, within the cache's capacity and
    the model's context length."""
    capacity_tokens = limits.capacity_tokens
    limit = min(limits.max_batched_tokens, capacity_tokens // 2, limits.max_model_len)
    sizes = sorted({size for size in (16, 64, 256, 1024) if size <= limit} | {min(limit, 1024)})
    shapes = [StepShape(((0, size),)) for size in sizes]
    context = min(1024, capacity_tokens // 2 - 256, limits.max_model_len - 256)
    if context > 0 and limit >= 256:
        shapes.append(StepShape(((context, 256),)))
    # Decode batches of two sizes at one context and of one size at two: what sets a decode
    # row's price and its price per pair.
    longest_decode_context = min(capacity_tokens // (2 * DECODE_ROWS), limits.max_model_len - 1)
    short_context = min(256, longest_decode_context)
    long_context = min(2048, longest_decode_context)
    if short_context > 0:
        for num_rows, decode_context in sorted(
            {(4, short_context), (DECODE_ROWS, short_context), (DECODE_ROWS, long_context)}
        ):
            shapes.append(StepShape(tuple((decode_context, 1) for _ in range(num_rows))))
    return shapes


def _scheduler_output(shape: StepShape, limits: CalibrationLimits) -> SchedulerOutput:
    chunks, next_block = [], 0
    for index, (start, count) in enumerate(shape.chunks):
        num_blocks = ceil_div(start + count, limits.block_size)
        chunks.append(
            ScheduledChunk(
                req_id=f"calibration-{index}",
                token_ids=[(1 + index + position) % limits.vocab_size for position in range(count)],
                start_position=start,
                block_table=list(range(next_block, next_block + num_blocks)),
                sample=SampleSpec(_GREEDY_ONE, 0, f"calibration-{index}"),
            )
        )
        next_block += num_blocks
    return SchedulerOutput(chunks=chunks)


def measure(runner: StepRunner, shape: StepShape, limits: CalibrationLimits, repeats: int = 2) -> float:
    """Fastest of `repeats` timed runs of the step. Only a first run pays one-time costs (a new
    shape's kernel set-up), and the fastest run is never it, so no untimed run is needed: each
    engine start saves a probe step."""
    output = _scheduler_output(shape, limits)
    timings = []
    for _ in range(repeats):
        start = time.perf_counter()
        runner.execute(output)
        timings.append(time.perf_counter() - start)
    return min(timings)


def fit(shapes: list[StepShape], seconds: list[float]) -> StepCostModel:
    """Least squares on [1, tokens, prefill pairs, decode rows, decode pairs] (a decode row is a
    token too); a negative coefficient is dropped."""
    features = np.array(
        [
            [1.0, tokens + decodes, prefill_pairs, decodes, decode_pairs]
            for tokens, prefill_pairs, decodes, decode_pairs in (s.work for s in shapes)
        ]
    )
    targets = np.array(seconds)
    active = [0, 1, 2, 3, 4]
    while True:
        solution, *_ = np.linalg.lstsq(features[:, active], targets, rcond=None)
        coefficients = dict(zip(active, solution))
        negative = [index for index, value in coefficients.items() if value < 0 and index != 1]
        if not negative:
            break
        active.remove(negative[0])
    return StepCostModel(
        seconds_fixed=max(0.0, float(coefficients.get(0, 0.0))),
        seconds_per_token=max(1e-9, float(coefficients.get(1, 0.0))),
        seconds_per_attention_pair=max(0.0, float(coefficients.get(2, 0.0))),
        seconds_per_decode_row=max(0.0, float(coefficients.get(3, 0.0))),
        seconds_per_decode_pair=max(0.0, float(coefficients.get(4, 0.0))),
    )


def calibrate(runner: StepRunner, limits: CalibrationLimits) -> StepCostModel:
    shapes = calibration_shapes(limits)
    seconds = [
        measure(runner, shape, limits, repeats=1 if shape.num_tokens >= SINGLE_RUN_TOKENS else 2)
        for shape in shapes
    ]
    model = replace(
        fit(shapes, seconds), seconds_one_decode=measure(runner, one_decode_shape(limits), limits, repeats=3)
    )
    logger.info("step cost model: %s (from %d synthetic steps)", model, len(shapes) + 1)
    return model


def one_decode_shape(limits: CalibrationLimits) -> StepShape:
    """A lone decode after a short context: the unit auto's chunk bound counts in."""
    return StepShape(((min(256, limits.max_model_len - 1, limits.capacity_tokens - 1), 1),))


def probe_shape(limits: CalibrationLimits) -> StepShape:
    """One cheap step of the calibration set: its largest fresh prefill of at most 256 tokens."""
    fresh = [
        shape for shape in calibration_shapes(limits) if len(shape.chunks) == 1 and shape.chunks[0][0] == 0
    ]
    small = [shape for shape in fresh if shape.num_tokens <= 256] or fresh[:1]
    return max(small, key=lambda shape: shape.num_tokens)


def predicts_probe(model: StepCostModel, measured_seconds: float, shape: StepShape) -> bool:
    predicted = model.predict(*shape.work)
    if predicted <= 0 or measured_seconds <= 0:
        return False
    return 1 / PROBE_TOLERANCE <= measured_seconds / predicted <= PROBE_TOLERANCE


def load_or_calibrate(
    runner: StepRunner,
    limits: CalibrationLimits,
    cache_file: str,
    threads: int,
    read_stat: Callable[[], str | None] | None = None,
) -> StepCostModel:
    """The cached model for this engine's identity if it still predicts a probe step, or a fresh
    measurement on `threads` threads (then cached, unless other work disturbed it: then a cached
    model, measured quietly, is kept instead). `read_stat`: the machine's CPU times."""
    cached = _load(cache_file)
    if cached is not None:
        shape = probe_shape(limits)
        if predicts_probe(cached, measure(runner, shape, limits), shape):
            return cached
        logger.info("cached step cost model %s mispredicts this machine now; measuring again", cache_file)
    model, cacheable = measured_for_cache(
        "the step cost model", lambda: calibrate(runner, limits), threads, read_stat
    )
    if cacheable:
        _save(model, cache_file)
    elif cached is not None:
        logger.warning("keeping the cached step cost model %s, measured on a quiet machine", cache_file)
        return cached
    return model


def _load(cache_file: str) -> StepCostModel | None:
    try:
        with open(cache_file, encoding="utf-8") as handle:
            stored = json.load(handle)
        if stored.pop("version") == CALIBRATION_VERSION:
            return StepCostModel(**stored)
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def _save(model: StepCostModel, cache_file: str) -> None:
    try:
        os.makedirs(os.path.dirname(cache_file), exist_ok=True)
        temporary = f"{cache_file}.{os.getpid()}.partial"
        with open(temporary, "w", encoding="utf-8") as handle:
            json.dump({"version": CALIBRATION_VERSION, **asdict(model)}, handle)
        os.replace(temporary, cache_file)
    except OSError as error:
        logger.warning("could not cache the step cost model at %s (%s)", cache_file, error)
