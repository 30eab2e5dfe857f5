"""Tools, benchmarks and tests read an engine through its inspection surface (`LLM.inspect()`,
`EngineCore.single_rank_model()`, `observing_stages()`, `forward_op_by_op()`), never by reaching
through it to the worker's model or runner: under tensor parallelism those are rank 0's alone, and
a reach-through ties the reader to how the engine happens to hold them.

Only the engine and the worker themselves, and the tests of their internals, may read them.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

REPO_DIR = pathlib.Path(__file__).resolve().parent.parent
# (folder, what inside it may reach: the modules that own the worker, and the tests of their internals)
SCANNED: list[tuple[str, tuple[str, ...]]] = [
    ("firsttoken", ("firsttoken/engine/", "firsttoken/worker/")),
    ("benchmarks", ()),
    ("tests", ("tests/engine/", "tests/worker/", "tests/cuda/", "tests/engine_state.py")),
]
# An attribute read of the second name on an attribute read of the first: `llm.core.worker`,
# `engine.worker.model`, `core.worker.runner`.
REACHES = {("core", "worker"), ("worker", "model"), ("worker", "runner")}


def reach_throughs(source: str) -> list[tuple[int, str]]:
    """(line, chain) of every reach-through in a module's source."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute):
            if (node.value.attr, node.attr) in REACHES:
                found.append((node.lineno, f".{node.value.attr}.{node.attr}"))
    return found


def _scanned_files() -> list[pathlib.Path]:
    files = []
    for folder, allowed in SCANNED:
        for path in sorted((REPO_DIR / folder).rglob("*.py")):
            relative = path.relative_to(REPO_DIR).as_posix()
            if not relative.startswith(allowed) and relative != "tests/test_inspection_surface.py":
                files.append(path)
    return files


def test_nothing_outside_the_engine_and_worker_reaches_through_to_the_model_or_runner():
    offenders = [
        f"{path.relative_to(REPO_DIR)}:{line}: {chain}"
        for path in _scanned_files()
        for line, chain in reach_throughs(path.read_text())
    ]
    assert not offenders, "read the engine through LLM.inspect() and friends:\n" + "\n".join(offenders)


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("llm.core.worker.model.layers", [(1, ".core.worker"), (1, ".worker.model")]),
        ("executor.worker.runner.sampler", [(1, ".worker.runner")]),
        ("llm.core.single_rank_model().layers\nllm.inspect().dtype", []),
    ],
)
def test_the_check_sees_a_reach_through(source, expected):
    assert sorted(reach_throughs(source)) == sorted(expected)
