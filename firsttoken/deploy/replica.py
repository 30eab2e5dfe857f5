"""EngineReplica: one AsyncEngine in a Ray Serve replica (a Ray actor), and what it reports to
the router: the block hashes of the prompts it served that its prefix cache still holds."""

from __future__ import annotations

import collections
import time
from typing import Any, AsyncIterator

from ray import serve

from firsttoken.core.hashing import BlockHash
from firsttoken.deploy.messages import Admitted, EngineInfo, GenerateCall, Refusal, ReplicaSnapshot
from firsttoken.deploy.routing import pack_keys, routing_key
from firsttoken.engine import AsyncEngine, EngineDeadError, TokenizedPrompt
from firsttoken.outputs import PinnedPrefix, RequestDelta

ENGINE_ERRORS = (ValueError, RuntimeError)  # InvalidInputError, QueueFullError, EngineDeadError


class ServedPrefixes:
    """The first block hashes of the prompts a replica served, most recent last, at most
    `max_blocks`: the candidates for what its prefix cache still holds."""

    def __init__(self, max_blocks: int) -> None:
        self.max_blocks = max_blocks
        self._block_hashes: collections.OrderedDict[BlockHash, None] = collections.OrderedDict()

    def record(self, block_hashes: tuple[BlockHash, ...]) -> None:
        for block_hash in block_hashes:
            self._block_hashes.pop(block_hash, None)
            self._block_hashes[block_hash] = None
        while len(self._block_hashes) > self.max_blocks:
            self._block_hashes.popitem(last=False)

    def keep_only(self, block_hashes: list[BlockHash]) -> None:
        """Forget the hashes not in `block_hashes` (evicted from the prefix cache)."""
        kept = set(block_hashes)
        for block_hash in [block_hash for block_hash in self._block_hashes if block_hash not in kept]:
            del self._block_hashes[block_hash]

    def block_hashes(self) -> list[BlockHash]:
        return list(self._block_hashes)


class EngineReplica:
    """Owns one AsyncEngine (started with the replica, shut down with it) and the prefixes it
    served; answers the ingress's calls and Ray Serve's health checks and routing-stats polls."""

    async def __init__(
        self,
        model: str | None,
        engine_options: dict[str, Any],
        system_prompt: str | None,
        max_reported_blocks: int,
    ) -> None:
        self._engine = AsyncEngine.from_options(model, system_prompt=system_prompt, **engine_options)
        await self._engine.start()
        self._name = serve.get_replica_context().replica_id.unique_id
        self._served = ServedPrefixes(max_reported_blocks)

    def info(self) -> EngineInfo:
        engine = self._engine
        return EngineInfo(
            tokenizer=engine.tokenizer,
            model_path=engine.model_path,
            vocab_size=engine.vocab_size,
            max_model_len=engine.max_model_len,
            max_request_tokens=engine.max_request_tokens,
            compute=engine.compute,
            max_waiting_requests=engine.max_waiting_requests,
            can_pin=engine.can_pin,
            block_size=engine.block_size,
            hash_root=engine.hash_root,
            pinned=engine.pinned_prefixes(),
        )

    async def generate(self, call: GenerateCall) -> AsyncIterator[Admitted | Refusal | RequestDelta]:
        """Admitted (or a Refusal), then the request's deltas; a Refusal ends the stream early
        if the engine stops. Cancelling the call (the client went away) aborts the request."""
        arrival_time = time.perf_counter() - call.waited_s
        prompt = TokenizedPrompt(call.token_ids, arrival_time, arrival_time + call.tokenize_s)
        try:
            stream = await self._engine.add_request(
                prompt,
                call.sampling_params,
                priority=call.priority,
                ttft_slo_ms=call.ttft_slo_ms,
                req_id=call.req_id,
            )
        except ENGINE_ERRORS as error:
            yield Refusal.of(error)
            return
        self._served.record(call.block_hashes)
        yield Admitted(self._name)
        try:
            async for delta in stream:
                yield delta
        except EngineDeadError as error:
            yield Refusal.of(error)
        finally:
            await stream.aclose()

    async def pin_system_prompt(self, system_prompt: str) -> PinnedPrefix | Refusal:
        if not self._engine.can_pin:
            return Refusal("invalid", "cannot be pinned: the prompt cache is disabled", "system_prompt")
        try:
            return await self._engine.pin_system_prompt(system_prompt)
        except ENGINE_ERRORS as error:
            return Refusal.of(error)

    async def unpin_prefix(self, pin_id: str) -> Refusal | None:
        try:
            await self._engine.unpin_prefix(pin_id)
        except ENGINE_ERRORS as error:
            return Refusal.of(error)
        return None

    async def sync(self, system_prompts: tuple[str, ...]) -> ReplicaSnapshot:
        """Pin whichever of the ingress's pinned system prompts this replica lacks (it may have
        started after they were pinned), and report its stats and pins."""
        for system_prompt in system_prompts:
            await self.pin_system_prompt(system_prompt)
        return ReplicaSnapshot(self._name, self._engine.stats(), self._engine.pinned_prefixes())

    async def record_routing_stats(self) -> dict[str, Any]:
        """Ray Serve's hook, polled every request_routing_stats_period_s: the routing keys of the
        served prefixes that the prefix cache still holds (the router's view of this replica)."""
        held = await self._engine.cached_block_hashes(self._served.block_hashes())
        self._served.keep_only(held)
        return {"prefix_keys": pack_keys(routing_key(block_hash) for block_hash in held)}

    def check_health(self) -> None:
        """Ray Serve's health check: a replica whose engine loop stopped is replaced."""
        if not self._engine.is_running:
            raise EngineDeadError(f"replica {self._name}: the engine is not running")

    async def __del__(self) -> None:
        await self._engine.shutdown()
