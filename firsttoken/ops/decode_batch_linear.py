"""float32 projections whose decode batches run on the native row matmul, where this machine
runs them faster there.

torch's float32 matmul (MKL's sgemm on x86) takes a small-n kernel for steps of a few rows. On a
2-core Xeon without AMX, SmolLM2-135M's projections took 19.4 ms at 8 rows against 6.8 at one,
where the native row matmul (`NativeRowInvariantLinear`) took 11.2; at one or two rows, and at a
prefill's hundreds, torch's was the faster. So each projection shape is timed at start at a few
row counts both ways, and the row counts where the native kernel wins by more than `MIN_GAIN`
take it. The native kernel reads its own packed copy of the weight (the weights' bytes again, or
the GGUF levels where the weight came from them).
"""

from __future__ import annotations

import functools
import logging
import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from firsttoken.ops import native
from firsttoken.ops.linear import Linear, NativeRowInvariantLinear, bias_of, replace_linears

logger = logging.getLogger(__name__)

# Row counts each projection shape is timed at: a lone decode, decode batches, a short chunk.
PROBE_ROWS = (1, 2, 4, 8, 16, 32)
# The native kernel takes a row count only where it is faster than torch's by more than this.
MIN_GAIN = 0.10
_REPEATS = 5


@dataclass(frozen=True)
class NativeRows:
    """The step sizes (rows, inclusive) a projection runs on the native row matmul."""

    min_rows: int
    max_rows: int

    def __contains__(self, rows: int) -> bool:
        return self.min_rows <= rows <= self.max_rows


def native_rows_from(timings: dict[int, tuple[float, float]]) -> NativeRows | None:
    """From each probed row count's (torch seconds, native seconds): the longest run of
    consecutive probes where the native kernel wins by more than `MIN_GAIN`, as the rows from its
    first probe to its last (those between probes behave as their neighbours); None where it
    wins nowhere."""
    best: list[int] = []
    run: list[int] = []
    for rows in sorted(timings):
        torch_s, native_s = timings[rows]
        if native_s < (1 - MIN_GAIN) * torch_s:
            run.append(rows)
            best = max(best, run, key=len)
        else:
            run = []
    return NativeRows(best[0], best[-1]) if best else None


class DecodeBatchLinear(nn.Module):
    """A float32 projection on torch's matmul, but for steps of `native_rows` rows, which take
    the native row matmul."""

    def __init__(
        self, linear: Linear, native_linear: NativeRowInvariantLinear, native_rows: NativeRows
    ) -> None:
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias
        self.native_linear = native_linear
        self.native_rows = native_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0] if x.dim() == 2 else x.numel() // x.shape[-1]
        if rows in self.native_rows:
            return self.native_linear(x)
        return F.linear(x, self.weight, self.bias)


def _median_seconds(function, repeats: int = _REPEATS) -> float:
    function()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


@functools.lru_cache(maxsize=64)
def _measured_native_rows(
    in_features: int, out_features: int, kernels: native.NativeKernels, num_threads: int
) -> NativeRows | None:
    """Time torch's matmul and the native row matmul on a random weight of this shape (the
    threads are part of the key: both kernels' speed depends on them)."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=generator)
    native_linear = NativeRowInvariantLinear(weight, None, kernels)
    timings = {}
    for rows in PROBE_ROWS:
        x = torch.randn(rows, in_features, generator=generator)
        torch_s = _median_seconds(lambda: F.linear(x, weight))
        native_s = _median_seconds(lambda: native_linear(x))
        timings[rows] = (torch_s, native_s)
    return native_rows_from(timings)


def measured_native_rows(linear: Linear, kernels: native.NativeKernels) -> NativeRows | None:
    """The step sizes at which this projection's shape runs faster on the native row matmul."""
    out_features, in_features = linear.weight.shape
    return _measured_native_rows(in_features, out_features, kernels, torch.get_num_threads())


def decode_batch_linear(linear: Linear, kernels: native.NativeKernels) -> nn.Module:
    """`linear` as a DecodeBatchLinear where the native matmul wins some step sizes, else as is."""
    native_rows = measured_native_rows(linear, kernels)
    if native_rows is None:
        return linear
    native_linear = NativeRowInvariantLinear(linear.weight.data, bias_of(linear), kernels)
    return DecodeBatchLinear(linear, native_linear, native_rows)


def convert_decode_batches(layers: nn.Module, lm_head: Linear, kernels: native.NativeKernels) -> nn.Module:
    """Every Linear below `layers` (in place) and `lm_head` (returned) as `decode_batch_linear`
    makes it."""
    replace_linears(layers, lambda linear: decode_batch_linear(linear, kernels))
    head = decode_batch_linear(lm_head, kernels)
    chosen = {
        tuple(module.weight.shape): module.native_rows
        for module in [*layers.modules(), head]
        if isinstance(module, DecodeBatchLinear)
    }
    logger.info("float32 steps on the native row matmul (measured faster here): %s", chosen or "none")
    return head
