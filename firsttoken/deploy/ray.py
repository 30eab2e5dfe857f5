"""The Ray Serve application: N engine replicas behind PrefixAwareRouter (or Ray's default
power-of-two router), and one ingress serving the single-process server's FastAPI app.

    serve run firsttoken.deploy.ray:build_app replicas=2 model=/models/x.gguf
    firsttoken serve --replicas 2            # the same, from the command line

The ingress is one replica (it only tokenizes and relays); scale the engine replicas.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from ray import serve
from ray.serve import Application
from ray.serve.config import AutoscalingConfig, RequestRouterConfig
from ray.serve.handle import DeploymentHandle
from starlette.types import ASGIApp

from firsttoken.deploy.client import ReplicaEngineClient, RouterCollector
from firsttoken.deploy.replica import EngineReplica
from firsttoken.deploy.router import PrefixAwareRouter
from firsttoken.metrics.prometheus import PrometheusMetrics
from firsttoken.server.app import create_app
from firsttoken.server.config import ServerConfig

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

    def autoscaling_config(self) -> AutoscalingConfig | None:
        if self.max_replicas is None:
            return None
        options: dict[str, Any] = {
            "min_replicas": self.min_replicas if self.min_replicas is not None else 1,
            "max_replicas": self.max_replicas,
            "initial_replicas": self.num_replicas,
        }
        if self.target_ongoing_requests is not None:
            options["target_ongoing_requests"] = self.target_ongoing_requests
        return AutoscalingConfig(**options)

    def request_router_config(self) -> RequestRouterConfig | None:
        if self.router == "pow2":
            return None  # Ray Serve's default
        return RequestRouterConfig(
            request_router_class=PrefixAwareRouter,
            request_router_kwargs={
                "imbalance_bound": self.imbalance_bound,
                "routed_memory_s": self.routed_memory_s,
            },
            request_routing_stats_period_s=self.routing_stats_period_s,
        )


@serve.ingress()
class OpenAIIngress:
    """The HTTP entry: owns the engine client of the replicas, its metrics and the app."""

    async def __init__(
        self, engines: DeploymentHandle, server_config: ServerConfig, replicas: ReplicasConfig
    ) -> None:
        self._config = server_config
        self._client = await ReplicaEngineClient.connect(
            engines, replicas.max_routing_blocks, replicas.sync_interval_s
        )
        self._metrics = PrometheusMetrics(
            server_config.model_name, self._client.stats, replica_stats=self._client.stats_by_replica
        )
        self._metrics.registry.register(RouterCollector(server_config.model_name, self._client.routed_counts))

    def __serve_build_asgi_app__(self) -> ASGIApp:
        return create_app(self._client, self._config, self._metrics)


def build_application(
    model: str | None,
    engine_options: dict[str, Any],
    server_config: ServerConfig,
    replicas: ReplicasConfig,
    system_prompt: str | None = None,
) -> Application:
    """The application: `replicas` engine replicas of `model` and the ingress in front."""
    engines = serve.deployment(
        EngineReplica,
        name="FirstTokenEngine",
        num_replicas="auto" if replicas.max_replicas is not None else replicas.num_replicas,
        autoscaling_config=replicas.autoscaling_config(),
        ray_actor_options={"num_cpus": replicas.num_cpus, "num_gpus": replicas.num_gpus},
        max_ongoing_requests=replicas.max_ongoing_requests,
        request_router_config=replicas.request_router_config(),
        # Loading and warming up a model takes longer than Ray's default health-check timeout.
        health_check_timeout_s=60,
    ).bind(model, engine_options, system_prompt, replicas.max_reported_blocks)
    ingress = serve.deployment(
        OpenAIIngress, name="FirstTokenIngress", num_replicas=1, ray_actor_options={"num_cpus": 0}
    )
    return ingress.bind(engines, server_config, replicas)


def build_app(args: dict[str, Any]) -> Application:
    """`serve run firsttoken.deploy.ray:build_app key=value ...` (or a Serve config's `args`).

    Keys: model, system_prompt_file, served_model_name, api_key, engine_options (a JSON object of
    LLM(...) keywords), and every ReplicasConfig field, `replicas` for num_replicas.
    """
    from firsttoken.engine_args import read_system_prompt
    from firsttoken.models.registry import resolve_model_path

    options = dict(args)
    model = resolve_model_path(options.pop("model", None))
    engine_options = options.pop("engine_options", {})
    if isinstance(engine_options, str):
        engine_options = json.loads(engine_options)
    system_prompt_file = options.pop("system_prompt_file", None)
    system_prompt = read_system_prompt(_Namespace(pin_system_prompt=system_prompt_file))
    names = options.pop("served_model_name", None)
    server_options = {"api_key": options.pop("api_key", None)}
    if names:
        server_options["served_model_names"] = tuple(str(names).split(","))
    else:
        server_options["served_model_names"] = (_model_name(model),)
    if "replicas" in options:
        options["num_replicas"] = options.pop("replicas")
    replicas = ReplicasConfig(**{name: _typed(name, value) for name, value in options.items()})
    return build_application(model, engine_options, ServerConfig(**server_options), replicas, system_prompt)


def _model_name(model_path: str) -> str:
    import os

    return os.path.basename(os.path.normpath(model_path)).removesuffix(".gguf")


@dataclass(frozen=True)
class _Namespace:
    pin_system_prompt: str | None


def _typed(name: str, value: Any) -> Any:
    """A ReplicasConfig value given as text (serve run's key=value) as its field's type."""
    fields = {field.name: field for field in dataclasses.fields(ReplicasConfig)}
    if name not in fields:
        raise ValueError(f"{name}: not an option (options: {', '.join(sorted(fields))})")
    if not isinstance(value, str):
        return value
    field_type = str(fields[name].type)
    if value.lower() == "none":
        return None
    if field_type.startswith("int"):
        return int(value)
    if field_type.startswith("float"):
        return float(value)
    return value
