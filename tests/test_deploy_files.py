"""The Dockerfiles install with the README's own commands, and the compose stack's pieces point at each
other (CI builds no image; these checks keep the files true to the code)."""

from __future__ import annotations

import json
import pathlib
import re
import shlex

import pytest
import yaml

from firsttoken.cli import build_parser

ROOT = pathlib.Path(__file__).parents[1]
DEPLOYMENT = ROOT / "deployment"
DOCKERFILES = [DEPLOYMENT / "docker" / "Dockerfile", DEPLOYMENT / "docker" / "Dockerfile.cuda"]


def _instructions(dockerfile: pathlib.Path) -> list[tuple[str, str]]:
    """(instruction, arguments) pairs, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n\s*", " ", dockerfile.read_text())
    pairs = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            instruction, _, arguments = line.partition(" ")
            pairs.append((instruction.upper(), arguments.strip()))
    return pairs


def _pip_installs(shell: str) -> list[str]:
    return [command.strip() for command in shell.split("&&") if command.strip().startswith("pip install")]


def _readme_main_command() -> str:
    readme = (ROOT / "README.md").read_text()
    return re.search(r"```bash\n(python3 -m venv .*?firsttoken generate .*?)\n```", readme)[1]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda path: path.name)
def test_dockerfile_installs_with_the_readme_commands(dockerfile):
    installs = [
        command
        for instruction, arguments in _instructions(dockerfile)
        if instruction == "RUN"
        for command in _pip_installs(arguments)
    ]
    assert installs == _pip_installs(_readme_main_command())


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda path: path.name)
def test_dockerfile_copies_files_that_exist_and_serves_with_valid_flags(dockerfile):
    instructions = _instructions(dockerfile)
    for instruction, arguments in instructions:
        if instruction == "COPY":
            for source in shlex.split(arguments)[:-1]:
                assert (ROOT / source).exists(), (
                    f"{dockerfile.name} copies {source}, which is not in the repository"
                )
    entrypoint = json.loads(
        next(arguments for instruction, arguments in instructions if instruction == "ENTRYPOINT")
    )
    assert entrypoint[0] == "firsttoken"
    args = build_parser().parse_args(entrypoint[1:])
    assert (args.verb, args.host, args.port) == ("serve", "0.0.0.0", 8000)


def test_compose_wires_server_prometheus_and_grafana():
    compose = yaml.safe_load((DEPLOYMENT / "compose.yaml").read_text())
    services = compose["services"]
    server = services["firsttoken"]
    dockerfile = DEPLOYMENT / server["build"]["context"] / server["build"]["dockerfile"]
    assert dockerfile.resolve() == DOCKERFILES[0]
    entrypoint = json.loads(next(a for i, a in _instructions(DOCKERFILES[0]) if i == "ENTRYPOINT"))
    build_parser().parse_args(entrypoint[1:] + server["command"])
    assert "8000:8000" in server["ports"]

    for service in ("prometheus", "grafana"):
        for volume in services[service]["volumes"]:
            host_path = volume.split(":")[0]
            assert (DEPLOYMENT / host_path).exists(), (
                f"{service} mounts {host_path}, which is not in deployment/"
            )

    prometheus = yaml.safe_load((DEPLOYMENT / "prometheus" / "prometheus.yml").read_text())
    targets = prometheus["scrape_configs"][0]["static_configs"][0]["targets"]
    assert targets == ["firsttoken:8000"]  # the service name and the port the server listens on

    datasource = yaml.safe_load((DEPLOYMENT / "grafana/provisioning/datasources/prometheus.yaml").read_text())
    assert datasource["datasources"][0]["type"] == "prometheus"
    assert datasource["datasources"][0]["url"] == "http://prometheus:9090"
    provider = yaml.safe_load((DEPLOYMENT / "grafana/provisioning/dashboards/firsttoken.yaml").read_text())
    dashboard_folder = provider["providers"][0]["options"]["path"]
    dashboard_mounts = [
        v for v in services["grafana"]["volumes"] if v.startswith("./grafana/firsttoken.json:")
    ]
    assert dashboard_mounts and dashboard_mounts[0].split(":")[1].startswith(dashboard_folder + "/")
