"""A tensor-parallel rank that dies or hangs ends the engine with a clear error in bounded time,
never a hang; the engine's requests end and free their blocks. (A failing step ends a server's
requests in-band: test_engine_fault.py.)"""

from __future__ import annotations

import os
import signal
import time

import pytest

from firsttoken import LLM, SamplingParams
from firsttoken.errors import TensorParallelError
from tests.models.tiny_models import save_hf_folder, tiny_hf_model

LONG = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return save_hf_folder(tiny_hf_model("llama"), str(tmp_path_factory.mktemp("tiny-llama")))


def _two_ranks(tiny_model: str, **options) -> LLM:
    return LLM(tiny_model, dtype="float32", kv_cache_memory_bytes=8 << 20, tensor_parallel_size=2, **options)


def _assert_stays_failed_with_every_block_free(llm: LLM) -> None:
    with pytest.raises(TensorParallelError):
        llm.generate(["Hello"], SamplingParams(max_tokens=2))
    stats = llm.stats()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks and stats.num_running == 0


def test_a_killed_rank_ends_the_engine_with_an_error_within_seconds(tiny_model):
    llm = _two_ranks(tiny_model)
    rank = llm.core.executor.rank_processes.processes[0]
    stream = llm.stream("Tell me a long story.", LONG)
    next(stream)
    os.kill(rank.pid, signal.SIGKILL)
    killed = time.monotonic()
    with pytest.raises(TensorParallelError, match="rank 1 was killed by SIGKILL"):
        for _ in stream:
            pass
    assert time.monotonic() - killed < 30
    _assert_stays_failed_with_every_block_free(llm)


@pytest.mark.slow  # waits out a collective's timeout; a killed rank is checked by default
def test_a_hung_rank_ends_the_engine_once_a_collective_times_out(tiny_model):
    llm = _two_ranks(tiny_model, distributed_timeout_s=3)
    rank = llm.core.executor.rank_processes.processes[0]
    stream = llm.stream("Tell me a long story.", LONG)
    next(stream)
    os.kill(rank.pid, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        with pytest.raises(TensorParallelError, match="timed out while every rank was alive"):
            for _ in stream:
                pass
        assert time.monotonic() - stopped < 30
    finally:
        os.kill(rank.pid, signal.SIGCONT) if rank.is_alive() else None
    assert not rank.is_alive()  # the engine ended it
    _assert_stays_failed_with_every_block_free(llm)
