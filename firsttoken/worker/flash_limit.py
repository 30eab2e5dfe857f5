"""The longest prompt the portable flash kernel attends before SDPA does, measured at start.

Without batch invariance a fresh prompt's attention may run on either kernel: the native flash
kernel (csrc/attention.c) or torch's SDPA flash kernel. Which is faster depends on the machine
and the length: on a 2-core Zen 4 the native kernel led at every length up to 4096, on other
CPUs SDPA has led beyond 1024. So where the choice exists, both time a causal prefill of the
model's attention shape at a few lengths, in turns, and the native kernel keeps the prompts up to
the longest length it wins at (and every shorter one). Cached as the compute choice is.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from firsttoken.attention.sdpa import causal_self_attention
from firsttoken.ops.native import NativeKernels
from firsttoken.worker.cpu_contention import measured_for_cache
from firsttoken.worker.compute_choice import ChoiceKey, ComputeRequest, choice_key, read_cached, write_cached

logger = logging.getLogger(__name__)

PROBE_LENGTHS = (512, 1024, 2048)
PROBE_RUNS = 3
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


@dataclass(frozen=True)
class AttentionShape:
    """What of a model's attention the two kernels are timed on."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype


@dataclass(frozen=True)
class LengthTiming:
    """A causal prefill of `queries` tokens' attention, seconds on each kernel (medians)."""

    queries: int
    flash_s: float
    sdpa_s: float


@dataclass(frozen=True)
class FlashLimit:
    """Fresh prompts of up to `max_queries` tokens attend on the native kernel (None: every
    length), longer ones on SDPA; the timings behind it and one line for the start-up log."""

    max_queries: int | None
    timings: tuple[LengthTiming, ...]
    reason: str

    def to_json(self) -> dict:
        return {"max_queries": self.max_queries, "timings": [asdict(timing) for timing in self.timings]}

    @classmethod
    def from_json(cls, data: dict) -> FlashLimit:
        return decide_limit([LengthTiming(**timing) for timing in data["timings"]])


def decide_limit(timings: list[LengthTiming]) -> FlashLimit:
    """The longest measured length at which the native kernel is no slower than SDPA, and at
    every shorter one; None where that is the longest measured; 0 where it loses at the shortest."""
    ordered = tuple(sorted(timings, key=lambda timing: timing.queries))
    max_queries: int | None = 0
    for timing in ordered:
        if timing.flash_s > timing.sdpa_s:
            break
        max_queries = timing.queries
    else:
        max_queries = None
    figures = ", ".join(
        f"{timing.queries}: {timing.flash_s * 1e3:.1f} vs {timing.sdpa_s * 1e3:.1f} ms" for timing in ordered
    )
    if max_queries is None:
        verdict = "every prompt on the native kernel"
    elif max_queries == 0:
        verdict = "every prompt on SDPA"
    else:
        verdict = f"prompts of up to {max_queries} tokens on the native kernel, longer ones on SDPA"
    reason = (
        f"prefill attention without invariance: {verdict}"
        f" (native vs SDPA, a layer's causal prefill, {figures})"
    )
    return FlashLimit(max_queries, ordered, reason)


def measure_lengths(
    native_kernels: NativeKernels,
    shape: AttentionShape,
    num_threads: int,
    lengths: tuple[int, ...] = PROBE_LENGTHS,
) -> list[LengthTiming]:
    """Each length's causal prefill attention on both kernels, the runs taking turns."""
    generator = torch.Generator().manual_seed(0)
    runs: list[tuple[int, Callable[[], object], Callable[[], object]]] = []
    for queries in lengths:

        def rows(heads: int, queries: int = queries) -> torch.Tensor:
            return torch.randn(queries, heads, shape.head_dim, generator=generator).to(shape.dtype)

        query, key, value = rows(shape.num_heads), rows(shape.num_kv_heads), rows(shape.num_kv_heads)
        out = torch.empty_like(query)

        def flash(query=query, key=key, value=value, out=out) -> object:
            return native_kernels.flash.flash_attention(query, key, value, num_threads, out=out)

        def sdpa(query=query, key=key, value=value) -> object:
            return causal_self_attention(query, key, value)

        runs.append((queries, flash, sdpa))
    samples = {queries: ([], []) for queries, _, _ in runs}
    for run in range(PROBE_RUNS + 1):  # the first round untimed: first calls set up
        for queries, flash, sdpa in runs:
            for kernel, seconds in zip((flash, sdpa), samples[queries], strict=True):
                started = time.perf_counter()
                kernel()
                if run:
                    seconds.append(time.perf_counter() - started)
    return [
        LengthTiming(queries, statistics.median(flash_s), statistics.median(sdpa_s))
        for queries, (flash_s, sdpa_s) in samples.items()
    ]


def flash_limit_key(native_kernels: NativeKernels, shape: AttentionShape, threads: int) -> ChoiceKey:
    shapes = f"flash-limit:q{shape.num_heads}:kv{shape.num_kv_heads}:d{shape.head_dim}"
    return choice_key(native_kernels.isa, threads, shapes, ComputeRequest(_DTYPE_NAMES[shape.dtype], False))


def load_or_measure_limit(
    cache_dir: str, native_kernels: NativeKernels, shape: AttentionShape, num_threads: int
) -> FlashLimit:
    """The cached limit for this machine and shape, else one measured now (~0.5 s) and cached."""
    key = flash_limit_key(native_kernels, shape, num_threads)
    path = os.path.join(cache_dir, "flash_limit", key.file_name())
    cached = read_cached(path, key)
    if cached is not None:
        try:
            return FlashLimit.from_json(cached)
        except (KeyError, TypeError, ValueError) as error:
            logger.warning("ignoring the cached flash limit %s (%s); measuring again", path, error)
    started = time.perf_counter()
    timings, cacheable = measured_for_cache(
        "the prefill attention's timings",
        lambda: measure_lengths(native_kernels, shape, num_threads),
        num_threads,
    )
    limit = decide_limit(timings)
    logger.info("measured the native and SDPA prefill attention in %.2f s", time.perf_counter() - started)
    if cacheable:
        write_cached(path, key, limit.to_json())
    return limit
