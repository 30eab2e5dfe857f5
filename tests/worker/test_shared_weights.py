"""Engines of one model in one process share its prepared weights (firsttoken/worker/shared_weights.py):
the same tokens as an engine with weights of its own, only between engines whose weights have the
same form, and none held once the engines are gone."""

from __future__ import annotations

import concurrent.futures
import gc
import logging

import pytest

from firsttoken import LLM, SamplingParams
from tests.conftest import FIXED_THREADS
from tests.models.tiny_models import write_smollm2_shaped_folder

SHARING_MESSAGE = "sharing the prepared weights of another engine in this process"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,"]
GREEDY = SamplingParams(max_tokens=12, temperature=0)


@pytest.fixture
def own_model_path(tmp_path) -> str:
    """A one-layer random-weight model of this test's own: no engine elsewhere in the test
    process holds its weights."""
    return write_smollm2_shaped_folder(str(tmp_path / "one-layer"), num_layers=1)


def _engine(model_path: str, **options) -> LLM:
    return LLM(model_path, kv_cache_memory_bytes=32 << 20, chunk_size=64, **FIXED_THREADS, **options)


def _tokens(llm: LLM) -> list[list[int]]:
    return [output.token_ids for output in llm.generate(PROMPTS, GREEDY)]


def _shared_in(caplog: pytest.LogCaptureFixture) -> bool:
    return any(record.getMessage() == SHARING_MESSAGE for record in caplog.records)


@pytest.mark.parametrize("options", [{"dtype": "float32"}, {"dtype": "float32", "quantization": "int8"}])
def test_a_second_engine_shares_the_first_ones_weights_and_gives_its_tokens(
    own_model_path, caplog, options
):
    caplog.set_level(logging.INFO, logger="firsttoken.worker.shared_weights")
    first = _engine(own_model_path, **options)
    assert not _shared_in(caplog)
    second = _engine(own_model_path, max_num_seqs=2, **options)
    assert _shared_in(caplog)
    assert _tokens(second) == _tokens(first)
    # Stepping the second engine left the first one's weights as they were.
    del second
    alone = _tokens(first)
    del first
    gc.collect()
    caplog.clear()
    assert _tokens(_engine(own_model_path, **options)) == alone
    assert not _shared_in(caplog)


def test_engines_with_weights_in_other_forms_build_their_own(own_model_path, caplog):
    caplog.set_level(logging.INFO, logger="firsttoken.worker.shared_weights")
    engines = [_engine(own_model_path, dtype="float32")]
    other_forms = [
        {"dtype": "bfloat16"},
        {"dtype": "float32", "quantization": "int8"},
        {"dtype": "float32", "fuse_ops": False},
    ]
    engines += [_engine(own_model_path, **options) for options in other_forms]
    assert not _shared_in(caplog)


def test_engines_sharing_weights_step_at_once_and_give_their_own_tokens(own_model_path):
    """Two engines on the same weights, each generating on its own thread at the same time (as a
    server's engine beside a batch job's): each gives the tokens it gives alone."""
    first = _engine(own_model_path, dtype="float32")
    second = _engine(own_model_path, dtype="float32")
    alone = _tokens(first)
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        at_once = [future.result() for future in [pool.submit(_tokens, first), pool.submit(_tokens, second)]]
    assert at_once == [alone, alone]
