"""The stages of a step that a profiler may time from outside: the engine reports their
boundaries to an observer while one is set, and does nothing more otherwise. (The model's own
stages, its layers, attention and MLP, are modules: torch's forward hooks see them.)"""

from __future__ import annotations

import contextlib
from typing import ContextManager, Protocol

LM_HEAD = "lm_head"  # the final norm and the projection onto the vocabulary
SAMPLING = "sampling"
DETOKENIZE = "detokenize"


class StageObserver(Protocol):
    def begin(self, stage: str) -> None: ...

    def end(self, stage: str) -> None: ...


class _Observed:
    def __init__(self, observer: StageObserver, stage: str) -> None:
        self.observer = observer
        self.stage = stage

    def __enter__(self) -> None:
        self.observer.begin(self.stage)

    def __exit__(self, *exc_info: object) -> None:
        self.observer.end(self.stage)


def observed(observer: StageObserver | None, stage: str) -> ContextManager[None]:
    """A context that reports `stage`'s start and end to `observer`; nothing without one."""
    return contextlib.nullcontext() if observer is None else _Observed(observer, stage)
