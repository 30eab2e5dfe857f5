"""ReplicasConfig: how the engine replicas are deployed and routed to (plain data, no Ray)."""

from __future__ import annotations

from dataclasses import dataclass, field

ROUTERS = ("prefix", "pow2")


@dataclass(frozen=True)
class ReplicasConfig:
    """How the engine replicas are deployed and routed to."""

    num_replicas: int = field(default=2, metadata={"help": "engine replicas (without autoscaling)"})
    min_replicas: int | None = field(default=None, metadata={"help": "autoscaling: fewest replicas"})
    max_replicas: int | None = field(default=None, metadata={"help": "autoscaling: most replicas"})
    target_ongoing_requests: float | None = field(
        default=None, metadata={"help": "autoscaling: requests per replica to scale towards"}
    )
    num_cpus: float = field(default=1.0, metadata={"help": "CPUs Ray reserves for each replica"})
    num_gpus: float = field(default=0.0, metadata={"help": "GPUs Ray reserves for each replica"})
    max_ongoing_requests: int = field(
        default=256, metadata={"help": "requests one replica takes at once; more wait in the router"}
    )
    router: str = field(
        default="prefix", metadata={"help": "prefix: prefix-cache aware; pow2: Ray's power of two choices"}
    )
    imbalance_bound: int = field(
        default=4,
        metadata={"help": "requests the best-matching replica may have beyond the least loaded"},
    )
    max_routing_blocks: int = field(default=64, metadata={"help": "a prompt's first blocks routed on"})
    max_reported_blocks: int = field(
        default=4096, metadata={"help": "prefix blocks a replica reports to the router at most"}
    )
    routing_stats_period_s: float = field(
        default=1.0, metadata={"help": "seconds between a replica's reports of its prefix cache"}
    )
    routed_memory_s: float = field(
        default=5.0, metadata={"help": "seconds the router remembers where it sent a prefix"}
    )
    sync_interval_s: float = field(
        default=1.0, metadata={"help": "seconds between the ingress's syncs of stats and pins"}
    )

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ValueError(f"replicas: must be >= 1, got {self.num_replicas}")
        if self.router not in ROUTERS:
            raise ValueError(f"router: must be one of {ROUTERS}, got {self.router!r}")
        if self.imbalance_bound < 0:
            raise ValueError(f"imbalance_bound: must be >= 0, got {self.imbalance_bound}")
        if self.max_routing_blocks < 1:
            raise ValueError(f"max_routing_blocks: must be >= 1, got {self.max_routing_blocks}")
        autoscaling = (self.min_replicas, self.max_replicas, self.target_ongoing_requests)
        if any(value is not None for value in autoscaling) and self.max_replicas is None:
            raise ValueError(
                "max_replicas: autoscaling needs it (with min_replicas and target_ongoing_requests)"
            )
