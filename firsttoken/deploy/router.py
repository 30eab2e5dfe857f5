"""PrefixAwareRouter: Ray Serve's request router for the engine replicas, deciding with
firsttoken.deploy.routing on what the replicas report and what this router sent lately."""

from __future__ import annotations

import time
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from firsttoken.deploy.messages import GenerateCall
from firsttoken.deploy.routing import (
    ReplicaView,
    RoutedPrefixes,
    num_matched_blocks,
    rank_replicas,
    routing_key,
    unpack_keys,
)


class ReportedPrefixes:
    """The routing keys each replica last reported (its record_routing_stats), unpacked once per
    report rather than once per request."""

    def __init__(self) -> None:
        self._reports: dict[str, tuple[bytes, frozenset[bytes]]] = {}

    def held(self, replica: str, routing_stats: dict[str, Any]) -> frozenset[bytes]:
        packed = routing_stats.get("prefix_keys", b"")
        cached = self._reports.get(replica)
        if cached is None or cached[0] is not packed:
            cached = (packed, unpack_keys(packed))
            self._reports[replica] = cached
        return cached[1]

    def forget(self, replica: str) -> None:
        self._reports.pop(replica, None)


class PrefixAwareRouter(RequestRouter):
    """Sends a generate call to the replica whose prefix cache holds the longest run of its first
    blocks, or to the least-loaded replica when none does or when the best one is more than
    `imbalance_bound` requests busier (firsttoken.deploy.routing.rank_replicas). Other calls
    (info, pins) go to the least loaded. Owns what it routed lately and the parsed reports.

    Requests are matched to replicas one by one (no FIFO mixin): a replica chosen for a
    request's prefix must serve that request, not whichever waited longest.
    """

    def initialize_state(self, imbalance_bound: int = 4, routed_memory_s: float = 5.0) -> None:
        self._imbalance_bound = imbalance_bound
        self._routed = RoutedPrefixes(routed_memory_s)
        self._reported = ReportedPrefixes()

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        request_keys = _request_keys(pending_request)
        now = time.monotonic()
        views = [self._view(replica, request_keys, now) for replica in candidate_replicas]
        by_name = {replica.replica_id.unique_id: replica for replica in candidate_replicas}
        if pending_request is not None:
            # Every candidate is ranked below: once all refused (queues full), back off.
            pending_request.routing_context.should_backoff = True
        return [[by_name[name]] for name in rank_replicas(views, self._imbalance_bound)]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        self._routed.record(replica_id.unique_id, _request_keys(pending_request), time.monotonic())

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._routed.forget(replica_id.unique_id)
        self._reported.forget(replica_id.unique_id)

    def _view(self, replica: RunningReplica, request_keys: list[bytes], now: float) -> ReplicaView:
        name = replica.replica_id.unique_id
        reported = self._reported.held(name, replica.routing_stats)
        routed = self._routed.held(name, now)
        held = reported | routed.keys()
        return ReplicaView(
            replica=name,
            num_ongoing=self.replica_queue_len_cache.get(replica.replica_id) or 0,
            num_matched_blocks=num_matched_blocks(request_keys, held),
            num_held_blocks=len(held),
        )


def _request_keys(pending_request: PendingRequest | None) -> list[bytes]:
    """The routing keys of a generate call's prompt; none for other calls."""
    if pending_request is None:
        return []
    calls = [arg for arg in pending_request.args if isinstance(arg, GenerateCall)]
    return [routing_key(block_hash) for block_hash in calls[0].block_hashes] if calls else []
