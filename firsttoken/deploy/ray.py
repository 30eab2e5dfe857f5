"""The Ray Serve application: N engine replicas behind PrefixAwareRouter (or Ray's default
power-of-two router), and one ingress serving the single-process server's FastAPI app.

    serve run firsttoken.deploy.ray:build_app replicas=2 model=/models/x.gguf
    firsttoken serve --replicas 2            # the same, from the command line

The ingress is one replica (it only tokenizes and relays); scale the engine replicas.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

from ray import serve
from ray.serve import Application
from ray.serve.config import AutoscalingConfig, RequestRouterConfig
from ray.serve.handle import DeploymentHandle
from starlette.types import ASGIApp

from firsttoken.deploy.client import ReplicaEngineClient, RouterCollector
from firsttoken.deploy.deploy_config import ReplicasConfig
from firsttoken.deploy.replica import EngineReplica
from firsttoken.deploy.router import PrefixAwareRouter
from firsttoken.metrics.prometheus import PrometheusMetrics
from firsttoken.models.registry import resolve_model_path
from firsttoken.server.app import create_app
from firsttoken.server.server_config import ServerConfig, default_model_name


def engine_deployment_options(replicas: ReplicasConfig) -> dict[str, Any]:
    """Ray Serve's options of the engine deployment: replicas or autoscaling, actor resources,
    and the request router (Ray's default power-of-two router when none is given)."""
    options: dict[str, Any] = {
        "ray_actor_options": {"num_cpus": replicas.num_cpus, "num_gpus": replicas.num_gpus},
        "max_ongoing_requests": replicas.max_ongoing_requests,
        # Loading and warming up a model takes longer than Ray's default health-check timeout, and
        # on a busy machine a replica stepping a long prefill answers late: three misses in a row
        # replace it, so the checks are rare and patient.
        "health_check_period_s": 30,
        "health_check_timeout_s": 120,
    }
    if replicas.max_replicas is None:
        options["num_replicas"] = replicas.num_replicas
    else:
        autoscaling = {
            "min_replicas": replicas.min_replicas if replicas.min_replicas is not None else 1,
            "max_replicas": replicas.max_replicas,
            "initial_replicas": replicas.num_replicas,
        }
        if replicas.target_ongoing_requests is not None:
            autoscaling["target_ongoing_requests"] = replicas.target_ongoing_requests
        options["autoscaling_config"] = AutoscalingConfig(**autoscaling)
    if replicas.router == "prefix":
        options["request_router_config"] = RequestRouterConfig(
            request_router_class=PrefixAwareRouter,
            request_router_kwargs={
                "imbalance_bound": replicas.imbalance_bound,
                "routed_memory_s": replicas.routed_memory_s,
            },
            request_routing_stats_period_s=replicas.routing_stats_period_s,
        )
    return options


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
        EngineReplica, name="FirstTokenEngine", **engine_deployment_options(replicas)
    ).bind(model, engine_options, system_prompt, replicas.max_reported_blocks)
    ingress = serve.deployment(
        OpenAIIngress, name="FirstTokenIngress", num_replicas=1, ray_actor_options={"num_cpus": 0}
    )
    return ingress.bind(engines, server_config, replicas)


def build_app(args: dict[str, Any]) -> Application:
    """`serve run firsttoken.deploy.ray:build_app key=value ...` (or a Serve config file's `args`).

    Keys: model, system_prompt_file, served_model_name (comma-separated), api_key,
    engine_options (a JSON object of LLM(...) keywords), and any ReplicasConfig field, with
    `replicas` for num_replicas. Values may be text (serve run) or typed (a config file).
    """
    options = dict(args)
    model = resolve_model_path(options.pop("model", None))
    engine_options = options.pop("engine_options", {})
    if isinstance(engine_options, str):
        engine_options = json.loads(engine_options)
    system_prompt_file = options.pop("system_prompt_file", None)
    system_prompt = (
        pathlib.Path(system_prompt_file).read_text(encoding="utf-8") if system_prompt_file else None
    )
    names = options.pop("served_model_name", None)
    server_config = ServerConfig(
        served_model_names=tuple(str(names).split(",")) if names else (default_model_name(model),),
        api_key=options.pop("api_key", None),
    )
    if "replicas" in options:
        options["num_replicas"] = options.pop("replicas")
    replicas = ReplicasConfig(**{name: _typed(name, value) for name, value in options.items()})
    return build_application(model, engine_options, server_config, replicas, system_prompt)


def _typed(name: str, value: Any) -> Any:
    """A ReplicasConfig value given as text (serve run's key=value) as its field's type."""
    fields = {field.name: field for field in dataclasses.fields(ReplicasConfig)}
    if name not in fields:
        raise ValueError(f"{name}: not an option of build_app (options: {', '.join(sorted(fields))})")
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
