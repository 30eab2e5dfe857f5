"""engine_for: one engine per option set, a fixed thread count unless asked otherwise, the least
recently asked for dropped beyond the bound (on a stand-in LLM: no model loads here)."""

from __future__ import annotations

import pytest

import firsttoken
from tests.conftest import FIXED_THREADS, MAX_SHARED_ENGINES, SharedEngines


class _RecordedLLM:
    """A stand-in for LLM that keeps what it was started with."""

    def __init__(self, model: str, **options) -> None:
        self.model = model
        self.options = options


@pytest.fixture
def shared(monkeypatch) -> SharedEngines:
    monkeypatch.setattr(firsttoken, "LLM", _RecordedLLM)
    return SharedEngines("model.gguf")


def test_the_same_options_give_the_same_engine_and_others_another(shared):
    engine = shared(dtype="float32", chunk_size=64)
    assert shared(chunk_size=64, dtype="float32") is engine
    assert shared(dtype="float32", chunk_size=512) is not engine
    assert engine.model == "model.gguf"
    assert engine.options == {**FIXED_THREADS, "dtype": "float32", "chunk_size": 64}


def test_threads_adapt_only_when_asked(shared):
    assert shared(adaptive_threads=True).options == {"adaptive_threads": True}


def test_beyond_the_bound_the_least_recently_asked_for_is_started_again(shared):
    first = shared(chunk_size=1)
    others = [shared(chunk_size=size) for size in range(2, MAX_SHARED_ENGINES + 1)]
    assert shared(chunk_size=1) is first  # asked for again: now the most recent
    shared(chunk_size=MAX_SHARED_ENGINES + 1)  # drops chunk_size=2, the least recent
    assert shared(chunk_size=1) is first
    assert shared(chunk_size=2) is not others[0]


def _census_patch_points() -> tuple:
    from firsttoken.engine.engine_core import EngineCore
    from firsttoken.worker import cost_calibration
    from firsttoken.worker.executor import Executor

    return EngineCore.__init__, Executor.warm_up, cost_calibration.calibrate, cost_calibration.probe_shape


def test_the_engine_census_patches_what_exists_and_puts_it_back():
    from tests.engine_census import EngineCensus

    originals = _census_patch_points()
    census = EngineCensus()
    census.install()
    try:
        assert [function.__wrapped__ for function in _census_patch_points()] == list(originals)
    finally:
        census.uninstall()
    assert _census_patch_points() == originals
