"""An opt-in pytest plugin that counts what makes the suite slow, per test module: engines started
(each `EngineCore`, so every LLM, AsyncEngine and in-process server), their warm-ups and their
step-cost measurements (full calibrations and cached-model probes).

Counts, not timings, so a run on a busy machine says as much as one on a quiet machine:
`python -m pytest -q -n 0 -p tests.engine_census tests/engine/test_generation.py` (-n 0: in one
process, since pytest-xdist workers would keep their counts to themselves).
"""

from __future__ import annotations

import collections
import functools
import pathlib
from typing import Any, Callable

import pytest

EVENTS = ("engine starts", "warm-ups", "calibrations", "calibration probes")


class EngineCensus:
    """Owns the counts of start-up work per test module, and the patches that take them."""

    def __init__(self) -> None:
        self.counts: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        self.module = "(collection)"
        self._undo: list[Callable[[], None]] = []

    def install(self) -> None:
        from firsttoken.engine import engine_core
        from firsttoken.worker import cost_calibration, executor

        self._count(engine_core.EngineCore, "__init__", "engine starts")
        self._count(executor.Executor, "warm_up", "warm-ups")
        # startup.py calls load_or_calibrate by its own name; the probe and the fit are looked up
        # in cost_calibration's namespace when it runs.
        self._count(cost_calibration, "calibrate", "calibrations")
        self._count(cost_calibration, "probe_shape", "calibration probes")

    def uninstall(self) -> None:
        for undo in reversed(self._undo):
            undo()

    def _count(self, owner: Any, name: str, event: str) -> None:
        original = getattr(owner, name)

        @functools.wraps(original)
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.counts[self.module][event] += 1
            return original(*args, **kwargs)

        setattr(owner, name, counted)
        self._undo.append(lambda: setattr(owner, name, original))

    def report(self) -> list[str]:
        width = max((len(module) for module in self.counts), default=10)
        lines = [f"{'module':<{width}}  " + "  ".join(EVENTS)]
        totals: collections.Counter[str] = collections.Counter()
        for module in sorted(self.counts):
            totals.update(self.counts[module])
            lines.append(self._row(module, self.counts[module], width))
        lines.append(self._row("total", totals, width))
        return lines

    @staticmethod
    def _row(label: str, counts: collections.Counter[str], width: int) -> str:
        return f"{label:<{width}}  " + "  ".join(f"{counts[event]:>{len(event)}}" for event in EVENTS)


_census = EngineCensus()


def pytest_configure(config: pytest.Config) -> None:
    _census.install()


def pytest_unconfigure(config: pytest.Config) -> None:
    _census.uninstall()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    # Module- and session-scoped fixtures start with a module's first test: they count there.
    _census.module = str(pathlib.Path(item.path).relative_to(item.config.rootpath))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    terminalreporter.section("engine census")
    for line in _census.report():
        terminalreporter.write_line(line)
