"""Errors a caller can cause, typed so that front ends map them without reading messages."""

from __future__ import annotations


class InvalidInputError(ValueError):
    """A value the caller gave is malformed or out of bounds; `field` names it (e.g. `max_tokens`,
    `messages[0].content`), and the message reads "field: what is wrong"."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class QueueFullError(RuntimeError):
    """The waiting queue is at `max_waiting_requests`; the caller should retry later."""


class SloUnattainableError(QueueFullError):
    """The request's TTFT objective cannot be met with the work queued ahead of it (the engine's
    slo_policy is "refuse"); `retry_after_s` is when a request like it could be."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class EngineDeadError(RuntimeError):
    """The engine loop stopped (an unexpected error, or shutdown); no request can run."""


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank died, failed, or kept a collective waiting past its timeout; the
    engine cannot step again."""
