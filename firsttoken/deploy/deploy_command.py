"""`firsttoken serve --replicas N`: the same server, as engine replicas on Ray Serve.

The flags are ReplicasConfig's fields; Ray is imported only when replicas are asked for.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import threading
from typing import Any

from firsttoken.deploy.deploy_config import ROUTERS, ReplicasConfig
from firsttoken.server import serve_command

APP_NAME = "firsttoken"
# Flags whose names differ from their field's.
_FLAG_NAMES = {"num_replicas": "replicas", "num_cpus": "replica_cpus", "num_gpus": "replica_gpus"}
_DEFAULTS = ReplicasConfig()
# Ray Serve's proxy must answer a health check within 10 s, three times running, or the start
# fails; on a busy machine still loading replicas it may not. A local Ray instance's processes
# inherit this process's environment: these are its defaults there (set values win).
PROXY_CHECK_ENVIRONMENT = {
    "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "60",
    "RAY_SERVE_PROXY_HEALTH_CHECK_PERIOD_S": "20",
    "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60",
}


def add_replica_args(serve: argparse.ArgumentParser) -> None:
    """Add the Ray Serve flags to `serve`, and serve on Ray when --replicas or --ray-address is given."""
    group = serve.add_argument_group("replicas (Ray Serve; needs the `ray` extra)")
    for field in dataclasses.fields(ReplicasConfig):
        flag = "--" + _FLAG_NAMES.get(field.name, field.name).replace("_", "-")
        default = getattr(_DEFAULTS, field.name)
        value_type = {"int": int, "float": float}.get(str(field.type).split(" ")[0], str)
        metavar = "SECONDS" if field.name.endswith("_s") else {int: "N", float: "X"}.get(value_type, None)
        options: dict[str, Any] = {
            "type": value_type,
            "default": None,
            "dest": "replicas_" + field.name,
            "metavar": metavar,
        }
        if field.name == "router":
            options["choices"] = ROUTERS
        group.add_argument(flag, help=f"{field.metadata['help']} (default: {default})", **options)
    group.add_argument(
        "--ray-address",
        default=None,
        help="a Ray cluster to deploy on, e.g. ray://head:10001 or auto (default: a local Ray instance)",
    )
    serve.set_defaults(handler=run_serve)


def replicas_config(args: argparse.Namespace) -> ReplicasConfig:
    """ReplicasConfig from the flags given (the others keep its defaults)."""
    given = {
        field.name: getattr(args, "replicas_" + field.name)
        for field in dataclasses.fields(ReplicasConfig)
        if getattr(args, "replicas_" + field.name) is not None
    }
    return ReplicasConfig(**given)


def run_serve(args: argparse.Namespace) -> int:
    if args.replicas_num_replicas is None and args.ray_address is None:
        return serve_command.run_serve(args)
    return run_replicated(args)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else 'no reason given'}"


def run_replicated(args: argparse.Namespace) -> int:
    """Deploy the application on Ray and serve until SIGINT or SIGTERM, then delete it."""
    import ray
    from ray import serve

    from firsttoken.deploy.ray import build_application
    from firsttoken.engine_args import read_system_prompt
    from firsttoken.models.registry import resolve_model_path

    replicas = replicas_config(args)
    system_prompt = read_system_prompt(args)
    model = resolve_model_path(args.model)
    config = serve_command.server_config(args, model)
    for name, value in PROXY_CHECK_ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    ray.init(address=args.ray_address)
    try:
        serve.start(http_options={"host": config.host, "port": config.port})
        engine_options = serve_command.engine_options(args)
        application = build_application(model, engine_options, config, replicas, system_prompt)
        serve.run(application, name=APP_NAME, route_prefix="/")
    except (ray.exceptions.RayError, RuntimeError) as error:
        # Ray's own traceback says which actor died and why, over many lines: one is enough here.
        message = f"firsttoken: error: the replicas did not start: {_first_line(error)}"
        print(message, file=sys.stderr, flush=True)
        ray.shutdown()
        return 1
    address = f"http://{config.host}:{config.port}"
    print(
        f"firsttoken: serving {config.model_name} on {address} with {replicas.num_replicas} replicas "
        f"({replicas.router} routing) on Ray Serve",
        file=sys.stderr,
        flush=True,
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(timeout=1.0):
        pass
    serve.delete(APP_NAME)
    ray.shutdown()
    return 0
