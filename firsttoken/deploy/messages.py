"""What crosses between the ingress and the engine replicas (pickled by Ray): plain data only.

Errors travel as a Refusal, not as exceptions: the engine's exceptions carry a field name that
Ray's exception wrapping would lose, and the ingress must answer 400, 429 or 503 as the
single-process server does.
"""

from __future__ import annotations

from dataclasses import dataclass

from firsttoken.core.hashing import BlockHash
from firsttoken.engine import (
    EngineDeadError,
    InvalidInputError,
    QueueFullError,
    SloUnattainableError,
    Tokenizer,
)
from firsttoken.outputs import EngineCompute, EngineStats, PinnedPrefix
from firsttoken.sampling_params import SamplingParams


@dataclass(frozen=True)
class EngineInfo:
    """What the ingress needs to know of the replicas' engine (all replicas run the same one):
    its limits, and its tokenizer, block size and hash root, to tokenize and hash prompts
    exactly as the replicas' prefix caches do."""

    tokenizer: Tokenizer
    model_path: str
    vocab_size: int
    max_model_len: int
    max_request_tokens: int
    compute: EngineCompute
    max_waiting_requests: int | None
    can_pin: bool
    block_size: int
    hash_root: BlockHash
    pinned: tuple[PinnedPrefix, ...]


@dataclass(frozen=True)
class GenerateCall:
    """One tokenized request for a replica. The times are durations, not timestamps: each
    process has its own clock, so the replica dates arrival back by `waited_s` on its own."""

    req_id: str
    token_ids: list[int]
    sampling_params: SamplingParams
    priority: int
    ttft_slo_ms: float | None  # its TTFT objective (None: the replica engine's)
    waited_s: float  # from arrival at the ingress to this call
    tokenize_s: float  # of those, tokenizing
    block_hashes: tuple[BlockHash, ...]  # the prompt's first block hashes: the router's keys


@dataclass(frozen=True)
class Admitted:
    """A replica's first answer to a GenerateCall: its engine took the request."""

    replica: str


@dataclass(frozen=True)
class Refusal:
    """An engine error, to be raised again on the ingress as what it was."""

    kind: str  # "invalid" (a ValueError), "queue_full", "slo" (SloUnattainableError) or "dead"
    message: str
    field: str | None = None
    retry_after_s: int | None = None

    @classmethod
    def of(cls, error: Exception) -> Refusal:
        if isinstance(error, InvalidInputError):
            return cls("invalid", str(error).removeprefix(f"{error.field}: "), error.field)
        if isinstance(error, ValueError):
            return cls("invalid", str(error))
        if isinstance(error, SloUnattainableError):
            return cls("slo", str(error), retry_after_s=error.retry_after_s)
        if isinstance(error, QueueFullError):
            return cls("queue_full", str(error))
        return cls("dead", str(error))

    def error(self) -> Exception:
        if self.kind == "invalid":
            return (
                ValueError(self.message)
                if self.field is None
                else InvalidInputError(self.field, self.message)
            )
        if self.kind == "queue_full":
            return QueueFullError(self.message)
        if self.kind == "slo":
            return SloUnattainableError(self.message, self.retry_after_s or 1)
        return EngineDeadError(self.message)


@dataclass(frozen=True)
class ReplicaSnapshot:
    """One replica as the ingress sees it between two syncs: its name, stats and pins."""

    replica: str  # its Ray Serve replica id, which metrics are labelled with
    stats: EngineStats
    pinned: tuple[PinnedPrefix, ...]
