"""`firsttoken serve --replicas N` on a machine too busy for Ray Serve's checks: the checks are
patient, and a start that fails anyway is one clear line and exit status 1, not Ray's traceback."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402

from firsttoken.cli import build_parser  # noqa: E402
from firsttoken.deploy import deploy_command  # noqa: E402
from firsttoken.deploy.ray import engine_deployment_options  # noqa: E402


def test_a_replica_start_that_fails_is_one_clear_line(monkeypatch, capsys):
    calls: list[str] = []
    monkeypatch.setattr(ray, "init", lambda **_: calls.append("init"))
    monkeypatch.setattr(ray, "shutdown", lambda: calls.append("shutdown"))

    def proxy_missed_its_checks(**_):
        raise ray.exceptions.ActorDiedError()

    monkeypatch.setattr(serve, "start", proxy_missed_its_checks)
    for name in deploy_command.PROXY_CHECK_ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)
    args = build_parser().parse_args(["serve", "--replicas", "2"])
    assert deploy_command.run_replicated(args) == 1
    error = capsys.readouterr().err
    assert error.startswith("firsttoken: error: the replicas did not start: ActorDiedError: ")
    assert error.count("\n") == 1 and "Traceback" not in error
    assert calls == ["init", "shutdown"]


def test_proxy_checks_are_patient_unless_set(monkeypatch):
    import os

    monkeypatch.setattr(ray, "init", lambda **_: None)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    monkeypatch.setattr(serve, "start", lambda **_: (_ for _ in ()).throw(RuntimeError("stop here")))
    monkeypatch.setenv("RAY_SERVE_PROXY_HEALTH_CHECK_PERIOD_S", "5")
    monkeypatch.delenv("RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S", raising=False)
    deploy_command.run_replicated(build_parser().parse_args(["serve", "--replicas", "2"]))
    assert os.environ["RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S"] == "60"
    assert os.environ["RAY_SERVE_PROXY_HEALTH_CHECK_PERIOD_S"] == "5"


def test_replica_health_checks_allow_a_busy_replica():
    args = build_parser().parse_args(["serve", "--replicas", "2"])
    options = engine_deployment_options(deploy_command.replicas_config(args))
    assert options["health_check_timeout_s"] >= 120 and options["health_check_period_s"] >= 30
