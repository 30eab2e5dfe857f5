"""The deployment's settings: command-line flags, serve run's key=value arguments, validation."""

from __future__ import annotations

import pytest

from firsttoken.cli import build_parser
from firsttoken.deploy.cli import replicas_config
from firsttoken.deploy.config import ReplicasConfig


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
    [({"num_replicas": 0}, "replicas"), ({"router": "random"}, "router"), ({"imbalance_bound": -1}, "imbalance_bound"),
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
