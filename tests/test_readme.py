"""Every code block of the README runs or is checked here: Python blocks are executed (those that call
a server against a test server), `firsttoken` command lines go through the CLI's own parser and the
main job runs for real, script lines name scripts and flags that exist, and set-up lines are the
ones CI and the Dockerfiles run. A block of any other kind fails, so no snippet goes unchecked."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

from firsttoken.cli import build_parser, main
from firsttoken.server.cli import server_config
from tests.server.conftest import running_server

ROOT = pathlib.Path(__file__).parents[1]
README = (ROOT / "README.md").read_text()
README_SERVER = "http://127.0.0.1:8000"
SET_UP_PREFIX = "python3 -m venv .venv && . .venv/bin/activate && pip install"
PYTEST_PREFIX = "python -m pytest "


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.DOTALL)


def _shell_lines() -> list[str]:
    """The README's shell command lines, trailing comments dropped."""
    lines = []
    for block in _blocks("bash"):
        for line in block.splitlines():
            command = re.sub(r"\s+#\s.*$", "", line).strip()
            if command:
                lines.append(command)
    return lines


def _commands(line: str) -> list[list[str]]:
    return [shlex.split(part) for part in line.split("&&")]


def test_every_fenced_block_is_python_or_bash():
    languages = [language for language, _ in re.findall(r"```(\w*)\n(.*?)```", README, flags=re.DOTALL)]
    assert set(languages) <= {"python", "bash"}


def test_set_up_commands_are_what_ci_runs():
    set_up = [line for line in _shell_lines() if line.startswith(SET_UP_PREFIX)]
    assert len(set_up) == 2, "the README holds exactly two set-up commands"
    main_job, tests = set_up
    assert main_job.split(" && ")[-1].startswith("firsttoken generate")
    ci_script = (ROOT / ".ci" / "run").read_text()
    install_and_test = tests.split(" && ", 2)[2]
    assert install_and_test in ci_script.replace("python -m pip install --quiet", "pip install")
    assert "    python -m pytest -q -m slow" in ci_script, "CI runs the slow tier too (while its time allows)"


@pytest.mark.usefixtures("model_path")  # the embedded model, loaded by the code under test
def test_main_job_generates_the_answer(capsys):
    main_job = next(line for line in _shell_lines() if line.startswith(SET_UP_PREFIX))
    generate = _commands(main_job)[-1]
    assert main(generate[1:]) == 0
    assert "Paris" in capsys.readouterr().out


def test_firsttoken_command_lines_parse():
    lines = [line for line in _shell_lines() if line.startswith("firsttoken ")]
    assert lines, "the README shows firsttoken commands"
    for line in lines:
        for command in _commands(line):
            try:
                build_parser().parse_args(command[1:])
            except SystemExit as error:
                raise AssertionError(f"README command does not parse: {line}") from error


@pytest.mark.engine  # a Python per bench script, each importing torch: too slow for the fast tier
def test_script_lines_name_scripts_and_flags_that_exist():
    for line in _shell_lines():
        command = shlex.split(line)
        if command[0] != "python" or not command[1].endswith(".py"):
            continue
        script = ROOT / command[1]
        assert script.exists(), f"README runs {command[1]}, which does not exist"
        usage = subprocess.run(
            [sys.executable, str(script), "--help"], capture_output=True, text=True, cwd=ROOT
        )
        assert usage.returncode == 0, usage.stderr
        for flag in (word for word in command[2:] if word.startswith("--")):
            assert flag in usage.stdout, f"{command[1]} has no {flag}"


def test_test_tier_lines_select_registered_markers():
    import tomllib

    pytest_options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    registered = {marker.split(":")[0] for marker in pytest_options["markers"]}
    lines = [line for line in _shell_lines() if line.startswith(PYTEST_PREFIX)]
    assert lines, "the README shows how to run one tier"
    for line in lines:
        command = shlex.split(line)
        selection = command[command.index("-m", 3) + 1]
        names = set(re.findall(r"\w+", selection)) - {"and", "or", "not"}
        assert names and names <= registered, f"README selects unregistered markers: {line}"


def test_no_shell_line_goes_unchecked():
    checked = ("firsttoken ", "python benchmarks/", "docker ", PYTEST_PREFIX, SET_UP_PREFIX)
    unchecked = [line for line in _shell_lines() if not line.startswith(checked)]
    assert not unchecked, f"add a check for these README lines: {unchecked}"


def _run_python_block(code: str) -> str:
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        exec(compile(code, "README.md", "exec"), {"__name__": "readme_snippet"})
    return stdout.getvalue()


@pytest.mark.usefixtures("model_path")  # the embedded model, loaded by the code under test
def test_offline_python_blocks_run():
    offline = [block for block in _blocks("python") if README_SERVER not in block]
    assert offline
    outputs = [_run_python_block(block) for block in offline]
    assert "The capital of France is Paris." in outputs[0]


@pytest.fixture(scope="module")
def server(model_path):
    """A server configured by the README's own `firsttoken serve` line (model names included)."""
    serve_line = next(line for line in _shell_lines() if line.startswith("firsttoken serve"))
    config = server_config(build_parser().parse_args(shlex.split(serve_line)[1:]), model_path)
    with running_server(model_path, dataclasses.replace(config, port=0)) as running:
        yield running


def test_server_python_blocks_run_against_a_server(server):
    served = [block for block in _blocks("python") if README_SERVER in block]
    assert served
    for block in served:
        _run_python_block(block.replace(README_SERVER, server.base_url))
