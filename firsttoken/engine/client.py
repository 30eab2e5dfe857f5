"""EngineClient: what a front end needs of an engine, whether one AsyncEngine in this process or
engine replicas behind a router (firsttoken.deploy); the server is written against this alone."""

from __future__ import annotations

from typing import Any, AsyncIterator, Protocol, Sequence

from firsttoken.engine.async_engine import RequestObserver
from firsttoken.engine.prompt_encoder import Messages, TextOrTokenIds, TokenizedPrompt
from firsttoken.outputs import EngineCompute, EngineStats, PinnedPrefix, RequestDelta
from firsttoken.sampling_params import SamplingParams
from firsttoken.tokenizer import Tokenizer


class DeltaStream(Protocol):
    """One admitted request's deltas; closing it before the end aborts the request."""

    req_id: str
    first_token_time: float | None  # when its first token reached the front end (perf_counter s)

    def __aiter__(self) -> AsyncIterator[RequestDelta]: ...

    async def aclose(self) -> None: ...


class EngineClient(Protocol):
    """An engine as the server sees it: limits, tokenizing, requests, pins, stats, life cycle."""

    tokenizer: Tokenizer
    model_path: str
    max_model_len: int
    compute: EngineCompute
    max_request_tokens: int
    max_waiting_requests: int | None

    @property
    def is_running(self) -> bool: ...

    @property
    def can_pin(self) -> bool: ...

    async def start(self) -> None: ...

    async def shutdown(self) -> None:
        """Stop; live requests end with EngineDeadError."""

    def add_observer(self, observer: RequestObserver) -> None: ...

    def stats(self) -> EngineStats: ...

    async def tokenize(
        self,
        prompt: TextOrTokenIds | None = None,
        *,
        messages: Messages | None = None,
        add_generation_prompt: bool = True,
        add_special_tokens: bool = True,
        chat_template_args: dict[str, Any] | None = None,
    ) -> TokenizedPrompt: ...

    async def detokenize(self, token_ids: Sequence[int]) -> str: ...

    async def add_request(
        self,
        prompt: TokenizedPrompt,
        sampling_params: SamplingParams,
        *,
        priority: int = 0,
        ttft_slo_ms: float | None = None,
        req_id: str | None = None,
    ) -> DeltaStream:
        """Returns once admitted; raises InvalidInputError, QueueFullError or EngineDeadError."""

    async def pin_system_prompt(self, system_prompt: str) -> PinnedPrefix: ...

    async def unpin_prefix(self, pin_id: str) -> None: ...

    def pinned_prefixes(self) -> tuple[PinnedPrefix, ...]: ...
