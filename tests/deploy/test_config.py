"""The deployment's settings: command-line flags, serve run's key=value arguments, validation."""

from __future__ import annotations

import pytest

from firsttoken.cli import build_parser
from firsttoken.deploy.deploy_command import replicas_config
from firsttoken.deploy.deploy_config import ReplicasConfig


def test_serve_flags_set_the_replicas_config():
    args = build_parser().parse_args(
        ["serve", "--replicas", "3", "--router", "pow2", "--max-replicas", "6", "--min-replicas", "2",
         "--target-ongoing-requests", "2.5", "--replica-gpus", "1", "--imbalance-bound", "8"]
    )  # fmt: skip
    assert replicas_config(args) == ReplicasConfig(
        num_replicas=3,
        router="pow2",
        max_replicas=6,
        min_replicas=2,
        target_ongoing_requests=2.5,
        num_gpus=1.0,
        imbalance_bound=8,
    )


def test_without_replica_flags_serve_stays_single_process():
    args = build_parser().parse_args(["serve"])
    assert args.replicas_num_replicas is None and args.ray_address is None
    assert replicas_config(args) == ReplicasConfig()


@pytest.mark.parametrize(
    ("options", "field"),
    [({"num_replicas": 0}, "replicas"), ({"router": "random"}, "router"),
     ({"imbalance_bound": -1}, "imbalance_bound"),
     ({"min_replicas": 1}, "max_replicas"), ({"max_routing_blocks": 0}, "max_routing_blocks")],
)  # fmt: skip
def test_bad_settings_name_the_field(options, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        ReplicasConfig(**options)


def test_serve_run_arguments_are_typed_and_checked():
    pytest.importorskip("ray")
    from firsttoken.deploy.ray import build_app

    with pytest.raises(ValueError, match="^replicas: must be >= 1"):
        build_app({"replicas": "0"})
    with pytest.raises(ValueError, match="^colour: not an option"):
        build_app({"colour": "blue"})
    assert build_app({"replicas": "2", "router": "pow2", "max_replicas": "none", "engine_options": "{}"})


def test_the_engine_deployment_options_pass_autoscaling_and_the_router_through():
    pytest.importorskip("ray")
    from firsttoken.deploy.ray import engine_deployment_options
    from firsttoken.deploy.router import PrefixAwareRouter

    fixed = engine_deployment_options(ReplicasConfig(num_replicas=3, num_gpus=1, imbalance_bound=7))
    assert fixed["num_replicas"] == 3 and "autoscaling_config" not in fixed
    assert fixed["ray_actor_options"] == {"num_cpus": 1.0, "num_gpus": 1}
    assert fixed["request_router_config"].request_router_kwargs["imbalance_bound"] == 7
    assert fixed["request_router_config"].get_request_router_class() is PrefixAwareRouter

    scaled = engine_deployment_options(
        ReplicasConfig(
            num_replicas=2, min_replicas=1, max_replicas=4, target_ongoing_requests=8, router="pow2"
        )
    )
    assert "num_replicas" not in scaled and "request_router_config" not in scaled
    autoscaling = scaled["autoscaling_config"]
    assert (autoscaling.min_replicas, autoscaling.max_replicas, autoscaling.initial_replicas) == (1, 4, 2)
    assert autoscaling.target_ongoing_requests == 8
