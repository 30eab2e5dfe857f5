"""Every code block of the README and of docs/ runs or is checked here: Python blocks are executed
(those that call a server against a test server), `firsttoken` command lines go through the CLI's
own parser and the main job runs for real, script lines name scripts and flags that exist, and
set-up lines are the ones CI and the Dockerfiles run. A block of any other kind fails, so no
snippet goes unchecked; every page is linked from the README and every relative link resolves."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import io
import json
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

from firsttoken.cli import build_parser, main
from firsttoken.server.serve_command import server_config
from tests.conftest import on_this_workers_cores
from tests.server.conftest import running_server

ROOT = pathlib.Path(__file__).parents[1]
README = ROOT / "README.md"
DOC_PAGES = sorted((ROOT / "docs").glob("*.md"))
# Measurement records behind the doc pages, each linked from the page it backs.
NOTE_PAGES = sorted((ROOT / "docs" / "notes").glob("*.md"))
PAGES = [README, *DOC_PAGES, *NOTE_PAGES]
README_MAX_LINES = 150
DOCS_SERVER = "http://127.0.0.1:8000"
SET_UP_PREFIX = "python3 -m venv .venv && . .venv/bin/activate && pip install"
PYTEST_PREFIX = "python -m pytest "
SCRIPT_PREFIX = "python benchmarks/"
CHECKED_PREFIXES = ("firsttoken ", SCRIPT_PREFIX, "docker ", PYTEST_PREFIX, SET_UP_PREFIX)
# Runs each script given with --help in one process (torch and firsttoken imported once) and
# prints {script: its usage text} as JSON.
_USAGES_OF_SCRIPTS = """
import contextlib, io, json, runpy, sys
usages = {}
for script in sys.argv[1:]:
    usage = io.StringIO()
    sys.argv = [script, "--help"]
    with contextlib.redirect_stdout(usage), contextlib.suppress(SystemExit):
        runpy.run_path(script, run_name="__main__")
    usages[script] = usage.getvalue()
sys.stdout.write(json.dumps(usages))
"""


def _page_name(page: pathlib.Path) -> str:
    return page.relative_to(ROOT).as_posix()


def _blocks(page: pathlib.Path, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", page.read_text(), flags=re.DOTALL)


def _shell_lines(page: pathlib.Path) -> list[str]:
    """A page's shell command lines, trailing comments dropped."""
    lines = []
    for block in _blocks(page, "bash"):
        for line in block.splitlines():
            command = re.sub(r"\s+#\s.*$", "", line).strip()
            if command:
                lines.append(command)
    return lines


def _all_shell_lines() -> list[str]:
    return [line for page in PAGES for line in _shell_lines(page)]


def _commands(line: str) -> list[list[str]]:
    return [shlex.split(part) for part in line.split("&&")]


def _offline_blocks(page: pathlib.Path) -> list[str]:
    return [block for block in _blocks(page, "python") if DOCS_SERVER not in block]


def _served_blocks(page: pathlib.Path) -> list[str]:
    return [block for block in _blocks(page, "python") if DOCS_SERVER in block]


def _run_python_blocks(page: pathlib.Path, blocks: list[str]) -> list[str]:
    """Runs a page's blocks in order in one namespace, as a reader would; returns what each printed."""
    namespace = {"__name__": "docs_snippet"}
    outputs = []
    with on_this_workers_cores():  # the page's `LLM()` takes this worker's share of the cores
        for block in blocks:
            stdout = io.StringIO()
            with contextlib.redirect_stdout(stdout):
                exec(compile(block, _page_name(page), "exec"), namespace)
            outputs.append(stdout.getvalue())
    namespace.clear()
    gc.collect()  # the page's engine goes before the next page builds its own
    return outputs


@pytest.mark.parametrize("page", PAGES, ids=_page_name)
def test_every_fenced_block_is_python_or_bash(page):
    languages = [language for language, _ in re.findall(r"```(\w*)\n(.*?)```", page.read_text(), re.DOTALL)]
    assert set(languages) <= {"python", "bash"}


@pytest.mark.parametrize("page", PAGES, ids=_page_name)
def test_no_shell_line_goes_unchecked(page):
    unchecked = [line for line in _shell_lines(page) if not line.startswith(CHECKED_PREFIXES)]
    assert not unchecked, f"add a check for these lines of {_page_name(page)}: {unchecked}"


@pytest.mark.parametrize("page", PAGES, ids=_page_name)
def test_relative_links_point_at_files_that_exist(page):
    targets = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", page.read_text())
    missing = [
        target for target in targets if "://" not in target and not (page.parent / target).exists()
    ]
    assert not missing, f"{_page_name(page)} links to files that do not exist: {missing}"


def test_every_doc_page_is_linked_from_the_readme():
    linked = set(re.findall(r"\]\((docs/[^)#]+\.md)", README.read_text()))
    assert {_page_name(page) for page in DOC_PAGES} <= linked


def test_every_note_page_is_linked_from_a_doc_page():
    linked = {
        (page.parent / target).resolve()
        for page in DOC_PAGES
        for target in re.findall(r"\]\((notes/[^)#]+\.md)", page.read_text())
    }
    assert {page.resolve() for page in NOTE_PAGES} <= linked


def test_readme_stays_short():
    assert len(README.read_text().splitlines()) <= README_MAX_LINES, "move the details to docs/"


def test_set_up_commands_are_what_ci_runs():
    set_up = [line for line in _all_shell_lines() if line.startswith(SET_UP_PREFIX)]
    assert set_up == [line for line in _shell_lines(README) if line.startswith(SET_UP_PREFIX)]
    assert len(set_up) == 2, "the README holds exactly two set-up commands"
    main_job, tests = set_up
    assert main_job.split(" && ")[-1].startswith("firsttoken generate")
    ci_script = (ROOT / ".ci" / "run").read_text()
    install_and_test = tests.split(" && ", 2)[2]
    assert install_and_test in ci_script.replace("python -m pip install --quiet", "pip install")
    assert "    python -m pytest -q -m slow" in ci_script, "CI runs the slow tier too (while its time allows)"


@pytest.mark.slow  # the README's command is also what CI's fresh install runs first
@pytest.mark.usefixtures("model_path")  # the embedded model, loaded by the code under test
def test_main_job_generates_the_answer(capsys):
    main_job = next(line for line in _shell_lines(README) if line.startswith(SET_UP_PREFIX))
    generate = _commands(main_job)[-1]
    assert main(generate[1:]) == 0
    assert "Paris" in capsys.readouterr().out


def test_firsttoken_command_lines_parse():
    lines = [line for line in _all_shell_lines() if line.startswith("firsttoken ")]
    assert lines, "the pages show firsttoken commands"
    for line in lines:
        for command in _commands(line):
            try:
                build_parser().parse_args(command[1:])
            except SystemExit as error:
                raise AssertionError(f"documented command does not parse: {line}") from error


@pytest.mark.engine  # the scripts import torch: too slow for the fast tier
def test_script_lines_name_scripts_and_flags_that_exist():
    flags_by_script: dict[str, set[str]] = {}
    for line in _all_shell_lines():
        if line.startswith(SCRIPT_PREFIX):
            script, *arguments = shlex.split(line)[1:]
            assert (ROOT / script).exists(), f"the docs run {script}, which does not exist"
            flags_by_script.setdefault(script, set()).update(a for a in arguments if a.startswith("--"))
    assert flags_by_script, "the docs show benchmark scripts"
    listed = subprocess.run(
        [sys.executable, "-c", _USAGES_OF_SCRIPTS, *flags_by_script],
        capture_output=True, text=True, cwd=ROOT, check=True,
    )
    usages = json.loads(listed.stdout)
    for script, flags in flags_by_script.items():
        assert usages[script].startswith("usage:"), f"{script} --help: {usages[script]!r}"
        for flag in flags:
            assert flag in usages[script], f"{script} has no {flag}"


def test_test_tier_lines_select_registered_markers():
    import tomllib

    pytest_options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    registered = {marker.split(":")[0] for marker in pytest_options["markers"]}
    lines = [line for line in _all_shell_lines() if line.startswith(PYTEST_PREFIX)]
    assert lines, "the README shows how to run one tier"
    for line in lines:
        command = shlex.split(line)
        selection = command[command.index("-m", 3) + 1]
        names = set(re.findall(r"\w+", selection)) - {"and", "or", "not"}
        assert names and names <= registered, f"the docs select unregistered markers: {line}"


@pytest.mark.usefixtures("model_path")  # the embedded model, loaded by the code under test
def test_readme_offline_python_blocks_run():
    outputs = _run_python_blocks(README, _offline_blocks(README))
    assert "The capital of France is Paris." in outputs[0]


@pytest.mark.slow  # each page's features have their own tests in the default run
@pytest.mark.usefixtures("model_path")  # the embedded model, loaded by the code under test
@pytest.mark.parametrize("page", [page for page in DOC_PAGES if _offline_blocks(page)], ids=_page_name)
def test_doc_offline_python_blocks_run(page):
    outputs = _run_python_blocks(page, _offline_blocks(page))
    assert all(outputs), f"every block of {_page_name(page)} prints what it shows"


@pytest.fixture(scope="module")
def server(model_path):
    """A server configured by the README's own `firsttoken serve` line (model names included)."""
    serve_line = next(line for line in _shell_lines(README) if line.startswith("firsttoken serve"))
    config = server_config(build_parser().parse_args(shlex.split(serve_line)[1:]), model_path)
    with running_server(model_path, dataclasses.replace(config, port=0)) as running:
        yield running


@pytest.mark.slow  # each page's features have their own tests in the default run
@pytest.mark.parametrize("page", [page for page in PAGES if _served_blocks(page)], ids=_page_name)
def test_served_python_blocks_run_against_a_server(page, server):
    blocks = [block.replace(DOCS_SERVER, server.base_url) for block in _served_blocks(page)]
    outputs = _run_python_blocks(page, blocks)
    assert all(outputs), f"every block of {_page_name(page)} prints what it shows"
