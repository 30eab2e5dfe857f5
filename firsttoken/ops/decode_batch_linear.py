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
_MIN_REPEATS = 2
_TIMING_BUDGET_S = 0.05


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


def _median_seconds(function) -> float:
    """The median of up to `_REPEATS` timed calls after a first one, as many as fit in
    `_TIMING_BUDGET_S` (a 1B model's LM head takes tens of ms a call; its noise is small)."""
    start = time.perf_counter()
    function()
    first = time.perf_counter() - start
    repeats = max(_MIN_REPEATS, min(_REPEATS, int(_TIMING_BUDGET_S / max(first, 1e-9))))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _timed_native_rows(weight: torch.Tensor, native_linear: NativeRowInvariantLinear) -> NativeRows | None:
    """Time torch's matmul and the native row matmul on this weight at each probed row count."""
    generator = torch.Generator().manual_seed(0)
    timings = {}
    for rows in PROBE_ROWS:
        x = torch.randn(rows, weight.shape[1], generator=generator)
        torch_s = _median_seconds(lambda: F.linear(x, weight))
        native_s = _median_seconds(lambda: native_linear(x))
        timings[rows] = (torch_s, native_s)
    return native_rows_from(timings)


# Each projection shape's step sizes, per kernels and thread count (both kernels' speed depends
# on them): the first weight of a shape is timed, the others of that shape take its answer.
_measured_rows: dict[tuple[int, int, native.NativeKernels, int], NativeRows | None] = {}


def decode_batch_linear(linear: Linear, kernels: native.NativeKernels) -> nn.Module:
    """`linear` as a DecodeBatchLinear where the native matmul wins some step sizes, else as is.
    The timing runs on the projection's own weight (a GGUF weight's levels included) and its
    packed copy, which serves it where the native matmul wins."""
    out_features, in_features = linear.weight.shape
    key = (in_features, out_features, kernels, torch.get_num_threads())
    native_linear = None
    if key not in _measured_rows:
        native_linear = NativeRowInvariantLinear(linear.weight.data, bias_of(linear), kernels)
        _measured_rows[key] = _timed_native_rows(linear.weight.data, native_linear)
    native_rows = _measured_rows[key]
    if native_rows is None:
        return linear
    if native_linear is None:
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
