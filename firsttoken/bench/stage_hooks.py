"""Times the stages of a request's TTFT from outside the model, only while profiling.

Forward hooks on the model, its decoder layers and their attention and MLP submodules, and the
engine's stage observer (the LM head, sampling, detokenizing: `EngineCore.observing_stages`),
read a clock at each boundary. Nothing stays installed after `instrumented()` exits, and the
model code needs no timing of its own; the layers' parts are found by attribute name, so a
changed forward (fused norms, a new layer body) is still classified, and one the hooks cannot
see fails loudly.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from firsttoken.outputs import RequestMetrics
from firsttoken.stage_observer import DETOKENIZE, LM_HEAD, SAMPLING

# The rows of a TTFT breakdown, in the order a request meets them.
STAGES: tuple[str, ...] = (
    "tokenize",
    "queue",
    "embedding",
    "attention",
    "mlp",
    "norms_residuals",
    "lm_head",
    "sampling",
    "detokenize",
    "other",
)
STAGE_LABELS: dict[str, str] = {
    "tokenize": "tokenize",
    "queue": "queue",
    "embedding": "embedding",
    "attention": "attention (all layers)",
    "mlp": "MLP (all layers)",
    "norms_residuals": "norms and residuals",
    "lm_head": "LM head (final norm + projection)",
    "sampling": "sampling",
    "detokenize": "detokenize",
    "other": "other (scheduling, inputs, outputs)",
}
ATTENTION_NAMES = ("self_attn", "attention", "attn")
MLP_NAMES = ("mlp", "feed_forward", "ffn")


@dataclass(frozen=True)
class EngineParts:
    """The objects of one engine whose calls the profiler times."""

    engine: Any  # an EngineCore: its observing_stages() reports the LM head, sampling, detokenizing
    model: nn.Module
    layers: list[nn.Module]
    attentions: list[nn.Module]
    mlps: list[nn.Module]


def find_engine_parts(engine: Any) -> EngineParts:
    """The timed parts of an EngineCore (its single_rank_model()'s layers), found by attribute
    name; a ValueError names what is missing."""
    model = engine.single_rank_model()
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise ValueError(f"profile: {type(model).__name__} has no `layers` ModuleList of decoder layers")
    return EngineParts(
        engine=engine,
        model=model,
        layers=list(layers),
        attentions=[
            _submodule(layer, index, ATTENTION_NAMES, "attention") for index, layer in enumerate(layers)
        ],
        mlps=[_submodule(layer, index, MLP_NAMES, "MLP") for index, layer in enumerate(layers)],
    )


def _submodule(layer: nn.Module, index: int, names: tuple[str, ...], what: str) -> nn.Module:
    for name in names:
        module = getattr(layer, name, None)
        if isinstance(module, nn.Module):
            return module
    raise ValueError(
        f"profile: decoder layer {index} ({type(layer).__name__}) has no {what} submodule "
        f"(looked for {', '.join(names)})"
    )


class StageClock:
    """Owns the seconds spent in each timed interval of one request, and how often each closed.

    On an accelerator every reading waits for queued kernels, so an interval holds the work
    launched inside it. With `trace`, each interval is also a profiler scope of the same name.
    """

    def __init__(self, device: torch.device, trace: bool = False) -> None:
        self.synchronize: Callable[[], None] | None = (
            None if device.type == "cpu" else torch.accelerator.synchronize
        )
        self.trace = trace
        self.seconds: defaultdict[str, float] = defaultdict(float)
        self.calls: Counter[str] = Counter()
        self._open: dict[str, tuple[float, Any]] = {}

    def now(self) -> float:
        if self.synchronize is not None:
            self.synchronize()
        return time.perf_counter()

    def begin(self, key: str) -> None:
        scope = torch.profiler.record_function(key) if self.trace else None
        if scope is not None:
            scope.__enter__()
        self._open[key] = (self.now(), scope)

    def end(self, key: str) -> None:
        """Close `key` if it is open (a boundary hook may close an interval that never began)."""
        if key not in self._open:
            return
        now = self.now()
        start, scope = self._open.pop(key)
        if scope is not None:
            scope.__exit__(None, None, None)
        self.seconds[key] += now - start
        self.calls[key] += 1

    def count(self, key: str) -> None:
        self.calls[key] += 1


@contextmanager
def instrumented(parts: EngineParts, clock: StageClock) -> Iterator[StageClock]:
    """Hooks and wrappers that feed `clock`, removed on exit whatever happens."""
    with ExitStack() as stack:

        def hook(module: nn.Module, pre: Callable[[], None], post: Callable[[], None]) -> None:
            stack.callback(module.register_forward_pre_hook(lambda *_: pre()).remove)
            stack.callback(module.register_forward_hook(lambda *_: post()).remove)

        def model_starts() -> None:
            clock.count("forward")
            clock.begin("embedding")  # everything before the first layer

        def layer_starts() -> None:
            clock.end("embedding")
            clock.end("between_layers")
            clock.begin("layer")

        def layer_ends() -> None:
            clock.end("layer")
            clock.begin("between_layers")  # until the next layer, or the model's last residual add

        hook(parts.model, model_starts, lambda: clock.end("between_layers"))
        for layer in parts.layers:
            hook(layer, layer_starts, layer_ends)
        for attention in parts.attentions:
            hook(attention, lambda: clock.begin("attention"), lambda: clock.end("attention"))
        for mlp in parts.mlps:
            hook(mlp, lambda: clock.begin("mlp"), lambda: clock.end("mlp"))
        stack.enter_context(parts.engine.observing_stages(clock))
        yield clock


def stage_seconds(
    parts: EngineParts, clock: StageClock, ttft_s: float, metrics: RequestMetrics
) -> dict[str, float]:
    """One request's TTFT split into STAGES; `other` is what no timed part covers.

    Raises ValueError when the hooks did not see every layer run, i.e. the model no longer
    calls its submodules as modules and the breakdown would be wrong.
    """
    _check_hooks_fired(parts, clock)
    seconds = clock.seconds
    stages = {
        "tokenize": metrics.tokenize_s,
        "queue": metrics.queue_s or 0.0,
        "embedding": seconds["embedding"],
        "attention": seconds["attention"],
        "mlp": seconds["mlp"],
        "norms_residuals": seconds["layer"]
        - seconds["attention"]
        - seconds["mlp"]
        + seconds["between_layers"],
        "lm_head": seconds[LM_HEAD],
        "sampling": seconds[SAMPLING],
        "detokenize": seconds[DETOKENIZE],
    }
    stages["other"] = ttft_s - sum(stages.values())
    return stages


def _check_hooks_fired(parts: EngineParts, clock: StageClock) -> None:
    calls = clock.calls
    expected = calls["forward"] * len(parts.layers)
    seen = {key: calls[key] for key in ("layer", "attention", "mlp")}
    if expected == 0 or any(count != expected for count in seen.values()):
        raise ValueError(
            f"profile: over {calls['forward']} model forward(s) of {len(parts.layers)} layers the hooks saw "
            f"{seen}; the model no longer calls its layers, attention and MLP as modules (compiled, or "
            "called through .forward?), so the stage breakdown cannot be measured"
        )
    for key in (LM_HEAD, SAMPLING, DETOKENIZE):
        if calls[key] == 0:
            raise ValueError(f"profile: the engine never reported its {key} stage in a step")
