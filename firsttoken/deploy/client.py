"""ReplicaEngineClient: the EngineClient of an ingress in front of engine replicas.

It tokenizes and hashes prompts itself (the replicas' tokenizer, block size and hash root), sends
each request to the replica the router picks, streams its deltas back, broadcasts pins to every
replica, and keeps every replica's stats from a periodic sync for /metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import ray.exceptions
from prometheus_client.metrics_core import CounterMetricFamily, Metric
from ray.serve.exceptions import RayServeException
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from firsttoken.deploy.messages import Admitted, EngineInfo, GenerateCall, Refusal, ReplicaSnapshot
from firsttoken.deploy.routing import prompt_block_hashes
from firsttoken.engine import (
    EngineDeadError,
    InvalidInputError,
    PromptEncoder,
    RequestObserver,
    TokenizedPrompt,
)
from firsttoken.metrics.prometheus import PREFIX
from firsttoken.outputs import EngineStats, PinnedPrefix, RequestDelta, RequestMetrics
from firsttoken.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

REPLICA_FAILURES = (ray.exceptions.RayError, RayServeException)
_TIMESTAMPS = (
    "arrival_time",
    "tokenized_time",
    "first_scheduled_time",
    "first_token_time",
    "last_token_time",
    "finished_time",
)


@dataclass
class RoutedCount:
    """Requests routed to one replica, and those it already held part of the prompt of in its
    prefix cache (their ratio is the router's hit ratio)."""

    num_requests: int = 0
    num_prefix_hits: int = 0


class RouterCollector:
    """Exports the routed counts as `firsttoken:router_requests_total` and
    `firsttoken:router_prefix_hits_total`, by replica, when scraped."""

    def __init__(self, model_name: str, routed_counts: Callable[[], Mapping[str, RoutedCount]]) -> None:
        self._model_name = model_name
        self._routed_counts = routed_counts

    def collect(self) -> Iterator[Metric]:
        labels = ["model_name", "replica"]
        requests = CounterMetricFamily(
            PREFIX + "router_requests", "Requests routed to each replica.", labels=labels
        )
        hits = CounterMetricFamily(
            PREFIX + "router_prefix_hits",
            "Routed requests whose replica held part of their prompt in its prefix cache.",
            labels=labels,
        )
        for replica, count in sorted(self._routed_counts().items()):
            requests.add_metric([self._model_name, replica], count.num_requests)
            hits.add_metric([self._model_name, replica], count.num_prefix_hits)
        yield requests
        yield hits


class ReplicaStream:
    """One request on a replica, seen from the ingress: its stream of replica items, the replica
    that took it, and when its tokens reached the ingress (perf_counter seconds).

    The replica's timestamps are on its own clock; deltas are moved onto this process's clock by
    the offset between the two arrival times, so that TTFT here counts the hops to the replica.
    """

    def __init__(
        self,
        req_id: str,
        arrival_time: float,
        response: DeploymentResponseGenerator,
        client: ReplicaEngineClient,
    ) -> None:
        self.req_id = req_id
        self.arrival_time = arrival_time
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.replica: str | None = None
        self.finished = False
        self._response = response
        self._client = client
        self._clock_offset: float | None = None
        self._ended = False
        self._shut_down = False

    def __aiter__(self) -> ReplicaStream:
        return self

    async def admitted(self) -> None:
        """Return once the replica's engine took the request; raise what refused it."""
        item = await self._next_item()
        if isinstance(item, Refusal):
            self._end()
            raise item.error()
        if not isinstance(item, Admitted):
            self._end()
            raise EngineDeadError(f"engine replica: expected an admission, got {type(item).__name__}")
        self.replica = item.replica

    async def __anext__(self) -> RequestDelta:
        if self._ended:
            raise StopAsyncIteration
        item = await self._next_item()
        if isinstance(item, Refusal):
            self._end()
            raise item.error()
        now = time.perf_counter()
        delta = self._on_this_clock(item)
        previous_token_time = self.last_token_time
        if delta.token_ids:
            if self.first_token_time is None:
                self.first_token_time = now
                assert self.replica is not None
                self._client.count_routed(self.replica, delta.num_cached_tokens)
            self.last_token_time = now
        for observer in self._client.observers:
            observer.on_delta(delta, now, previous_token_time)
        if delta.finished:
            self.finished = True
            self._end()
        return delta

    async def aclose(self) -> None:
        """Cancel the request on its replica (which aborts it there) unless it finished."""
        if not self.finished:
            self._response.cancel()
        self._end()

    def shut_down(self) -> None:
        """End this request now: the ingress is shutting down."""
        self._shut_down = True
        self._response.cancel()

    async def _next_item(self) -> Any:
        try:
            return await self._response.__anext__()
        except StopAsyncIteration:
            raise EngineDeadError(f"engine replica {self.replica}: the stream ended early") from None
        except REPLICA_FAILURES as error:
            if self._shut_down:
                raise EngineDeadError("the server was shut down") from error
            raise EngineDeadError(
                f"engine replica {self.replica or '(not yet routed)'} failed: {_first_line(error)}"
            ) from error

    def _on_this_clock(self, delta: RequestDelta) -> RequestDelta:
        if self._clock_offset is None:
            self._clock_offset = self.arrival_time - delta.metrics.arrival_time
        return dataclasses.replace(delta, metrics=_shifted(delta.metrics, self._clock_offset))

    def _end(self) -> None:
        self._ended = True
        self._client.live_streams.discard(self)


class ReplicaEngineClient:
    """Owns the ingress's view of the engine replicas: their handle, the engine's description,
    the prompt encoder, the live requests, the pinned system prompts and the latest sync."""

    def __init__(
        self,
        handle: DeploymentHandle,
        info: EngineInfo,
        max_routing_blocks: int,
        sync_interval_s: float,
    ) -> None:
        self.tokenizer = info.tokenizer
        self.model_path = info.model_path
        self.max_model_len = info.max_model_len
        self.max_request_tokens = info.max_request_tokens
        self.compute = info.compute
        self.max_waiting_requests = info.max_waiting_requests
        self.observers: list[RequestObserver] = []
        self.live_streams: set[ReplicaStream] = set()
        self._handle = handle
        self._generate = handle.options(method_name="generate", stream=True)
        self._info = info
        self._encoder = PromptEncoder(info.tokenizer, info.vocab_size)
        self._max_routing_blocks = max_routing_blocks
        self._sync_interval_s = sync_interval_s
        self._req_ids = (f"{uuid.uuid4().hex[:8]}-{number}" for number in itertools.count())
        self._pins = {pinned.pin_id: pinned for pinned in info.pinned}
        self._pinned_prompts: dict[str, str] = {}  # pinned at run time: replacements need them too
        self._snapshots: dict[str, ReplicaSnapshot] = {}
        self._routed_counts: dict[str, RoutedCount] = {}
        self._sync_task: asyncio.Task[None] | None = None
        self._stopped = False

    @classmethod
    async def connect(
        cls, handle: DeploymentHandle, max_routing_blocks: int, sync_interval_s: float
    ) -> ReplicaEngineClient:
        """Ask a replica what engine they run, then sync once so that /metrics starts full."""
        info: EngineInfo = await handle.info.remote()
        client = cls(handle, info, max_routing_blocks, sync_interval_s)
        await client._sync()
        return client

    # -- life cycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        self._sync_task = asyncio.create_task(self._sync_forever())

    async def shutdown(self) -> None:
        """Stop syncing and end every live request (EngineDeadError); the replicas keep running."""
        self._stopped = True
        if self._sync_task is not None:
            self._sync_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sync_task
        for stream in list(self.live_streams):
            stream.shut_down()
        self._encoder.shutdown()

    @property
    def is_running(self) -> bool:
        return not self._stopped and bool(self._snapshots)

    @property
    def can_pin(self) -> bool:
        return self._info.can_pin

    def add_observer(self, observer: RequestObserver) -> None:
        self.observers.append(observer)

    # -- requests ------------------------------------------------------------------------------

    async def tokenize(
        self,
        prompt: str | Sequence[int] | None = None,
        *,
        messages: Sequence[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        add_special_tokens: bool = True,
        chat_template_args: dict[str, Any] | None = None,
    ) -> TokenizedPrompt:
        return await self._encoder.tokenize(
            prompt,
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            add_special_tokens=add_special_tokens,
            chat_template_args=chat_template_args,
        )

    async def detokenize(self, token_ids: Sequence[int]) -> str:
        return await self._encoder.detokenize(token_ids)

    async def add_request(
        self,
        prompt: TokenizedPrompt,
        sampling_params: SamplingParams,
        *,
        priority: int = 0,
        ttft_slo_ms: float | None = None,
        req_id: str | None = None,
    ) -> ReplicaStream:
        """Send the request to the replica the router picks; returns once that replica's engine
        took it. Raises what the engine raised, or EngineDeadError when the replica failed."""
        if self._stopped:
            raise EngineDeadError("the server was shut down")
        info = self._info
        block_hashes = prompt_block_hashes(
            prompt.token_ids, info.block_size, info.hash_root, self._max_routing_blocks
        )
        req_id = req_id or next(self._req_ids)
        call = GenerateCall(
            req_id=req_id,
            token_ids=prompt.token_ids,
            sampling_params=sampling_params,
            priority=priority,
            ttft_slo_ms=ttft_slo_ms,
            waited_s=time.perf_counter() - prompt.arrival_time,
            tokenize_s=prompt.tokenized_time - prompt.arrival_time,
            block_hashes=tuple(block_hashes),
        )
        stream = ReplicaStream(req_id, prompt.arrival_time, self._generate.remote(call), self)
        self.live_streams.add(stream)
        try:
            await stream.admitted()
        except BaseException:
            await stream.aclose()
            raise
        return stream

    # -- pinned prefixes -----------------------------------------------------------------------

    async def pin_system_prompt(self, system_prompt: str) -> PinnedPrefix:
        """Pin on every replica; returns once all have computed it (replicas started later pin
        it at their first sync)."""
        results = await self._broadcast("pin_system_prompt", system_prompt)
        if not results:
            raise EngineDeadError("no engine replica is running")
        refusals = [result for result in results if isinstance(result, Refusal)]
        if refusals:
            raise refusals[0].error()
        pinned: PinnedPrefix = results[0]
        self._pins[pinned.pin_id] = pinned
        self._pinned_prompts[pinned.pin_id] = system_prompt
        return pinned

    async def unpin_prefix(self, pin_id: str) -> None:
        if pin_id not in self._pins:
            raise InvalidInputError("pin_id", f"no pinned prefix {pin_id!r}")
        self._pinned_prompts.pop(pin_id, None)
        del self._pins[pin_id]
        await self._broadcast("unpin_prefix", pin_id)

    def pinned_prefixes(self) -> tuple[PinnedPrefix, ...]:
        return tuple(self._pins.values())

    # -- stats ---------------------------------------------------------------------------------

    def stats_by_replica(self) -> Mapping[str, EngineStats]:
        """Each replica's engine stats as of the latest sync."""
        return {name: snapshot.stats for name, snapshot in self._snapshots.items()}

    def stats(self) -> EngineStats:
        """The replicas' stats summed (KV usage: used blocks over all blocks)."""
        snapshots = [snapshot.stats for snapshot in self._snapshots.values()]
        total = {
            field.name: sum(getattr(stats, field.name) for stats in snapshots)
            for field in dataclasses.fields(EngineStats)
            if field.type == "int"
        }
        num_blocks = total["num_kv_blocks"]
        return EngineStats(
            **total,
            kv_cache_usage=1.0 - total["num_free_kv_blocks"] / num_blocks if num_blocks else 0.0,
            spec_decode_accepted_per_position=tuple(
                sum(counts)
                for counts in itertools.zip_longest(
                    *(stats.spec_decode_accepted_per_position for stats in snapshots), fillvalue=0
                )
            ),
        )

    def routed_counts(self) -> Mapping[str, RoutedCount]:
        return self._routed_counts

    def count_routed(self, replica: str, num_cached_tokens: int) -> None:
        """Count a request that reached its first token on `replica`."""
        count = self._routed_counts.setdefault(replica, RoutedCount())
        count.num_requests += 1
        if num_cached_tokens > 0:
            count.num_prefix_hits += 1

    # -- sync ----------------------------------------------------------------------------------

    async def _sync_forever(self) -> None:
        while True:
            await asyncio.sleep(self._sync_interval_s)
            try:
                await self._sync()
            except Exception:  # a replica going away mid-broadcast: the next sync sees the rest
                logger.warning("replica sync failed", exc_info=True)

    async def _sync(self) -> None:
        results = await self._handle.broadcast("sync", tuple(self._pinned_prompts.values())).results_async(
            timeout_s=max(30.0, 10 * self._sync_interval_s), return_exceptions=True
        )
        self._snapshots = {
            result.replica: result for result in results if isinstance(result, ReplicaSnapshot)
        }

    async def _broadcast(self, method_name: str, *args: Any) -> list[Any]:
        results = await self._handle.broadcast(method_name, *args).results_async(return_exceptions=True)
        failures = [result for result in results if isinstance(result, BaseException)]
        if failures:
            raise EngineDeadError(f"engine replica failed: {_first_line(failures[0])}")
        return results


def _shifted(metrics: RequestMetrics, offset: float) -> RequestMetrics:
    moved = {
        name: getattr(metrics, name) + offset for name in _TIMESTAMPS if getattr(metrics, name) is not None
    }
    return dataclasses.replace(metrics, **moved)


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"
