"""Validation and refusals never wait behind an engine step: while a step runs (here one held
open on purpose), a request no load could ever run is refused, and tokenization answers."""

from __future__ import annotations

import asyncio
import threading

import pytest

from firsttoken.engine import AsyncEngine, InvalidInputError
from firsttoken.sampling_params import SamplingParams
from tests.conftest import FIXED_THREADS

MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def engine(model_path):
    return AsyncEngine.from_options(
        model_path,
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        chunk_size=32,
        kv_cache_memory_bytes=32 << 20,
        **FIXED_THREADS,
    )


class _HeldStep:
    """Wraps the core's step: the first step that runs after `hold()` waits until `release()`."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.step = engine.core.step
        self.entered = threading.Event()
        self.released = threading.Event()
        self.events: list[str] = []
        engine.core.step = self

    def __call__(self):
        if not self.released.is_set():
            self.entered.set()
            self.released.wait(timeout=60)
        return self.step()

    def release(self) -> None:
        self.events.append("step released")
        self.released.set()


def test_a_refusal_and_a_tokenization_do_not_wait_for_the_running_step(engine):
    held = _HeldStep(engine)

    async def scenario() -> None:
        await engine.start()
        try:
            running = await engine.add_request(await engine.tokenize("Hello"), SamplingParams(max_tokens=4))
            await asyncio.to_thread(held.entered.wait, 60)
            too_long = await engine.tokenize([28] * 200)
            try:
                # A client's patience, not a duration claim: before, this waited for the step.
                await asyncio.wait_for(engine.add_request(too_long, SamplingParams(max_tokens=100)), 20)
            except InvalidInputError as error:
                held.events.append(f"refused {error.field}")
            except asyncio.TimeoutError:
                held.events.append("still waiting")
            await asyncio.wait_for(engine.tokenize("Tokenized meanwhile"), 20)
            held.events.append("tokenized")
            held.release()
            assert [delta async for delta in running][-1].finish_reason == "length"
        finally:
            held.release()
            await engine.shutdown()

    asyncio.run(scenario())
    assert held.events[:3] == ["refused max_tokens", "tokenized", "step released"]
