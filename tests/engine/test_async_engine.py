"""AsyncEngine: the step loop in its own thread, behind asyncio; no HTTP involved."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from firsttoken import SamplingParams
from firsttoken.config import EngineConfig
from firsttoken.engine.async_engine import AsyncEngine
from firsttoken.errors import EngineDeadError, InvalidInputError, QueueFullError
from firsttoken.engine.engine_core import EngineCore
from firsttoken.metrics.prometheus import PrometheusMetrics
from firsttoken.sampling_params import StructuredOutput
from tests.conftest import FIXED_THREADS
from tests.prompts import SHORT_PROMPTS, long_prompt

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def core(model_path):
    """One engine core for the module; each test wraps it in a fresh AsyncEngine."""
    config = EngineConfig.from_kwargs(
        model=model_path,
        dtype="float32",
        kv_cache_memory_bytes=64 << 20,
        chunk_size=64,
        max_model_len=1024,
        max_num_seqs=1,
        max_waiting_requests=3,
        **FIXED_THREADS,
    )
    return EngineCore(config)


def run(core: EngineCore, test) -> None:
    """Run `test(engine)` in an event loop with a started AsyncEngine over `core`."""

    async def main() -> None:
        engine = AsyncEngine(core)
        await engine.start()
        try:
            await test(engine)
        finally:
            await engine.shutdown()

    asyncio.run(main())
    assert not core.has_unfinished_requests()
    assert core.kv_manager.pool.num_free_blocks == core.kv_manager.num_blocks


async def wait_until_idle(engine: AsyncEngine, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = engine.stats()
        if stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_cache_usage == 0:
            return
        assert time.monotonic() < deadline, stats
        await asyncio.sleep(0.01)


def test_concurrent_generations_equal_llm_generate(core, llm):
    prompts = SHORT_PROMPTS[:3]
    expected = [output.token_ids for output in llm.generate(prompts, GREEDY)]

    async def test(engine: AsyncEngine) -> None:
        async def token_ids(prompt: str) -> list[int]:
            return [
                token
                for delta in [d async for d in engine.generate(prompt, GREEDY)]
                for token in delta.token_ids
            ]

        assert await asyncio.gather(*(token_ids(prompt) for prompt in prompts)) == expected

    run(core, test)


def test_chat_messages_use_the_template(core, llm):
    messages = [{"role": "user", "content": "Say hello."}]
    expected = llm.chat(messages, GREEDY)

    async def test(engine: AsyncEngine) -> None:
        prompt = await engine.tokenize(messages=messages)
        assert prompt.token_ids == expected.prompt_token_ids
        assert prompt.arrival_time <= prompt.tokenized_time
        text = "".join(
            [delta.text async for delta in engine.generate(messages=messages, sampling_params=GREEDY)]
        )
        assert text == expected.text

    run(core, test)


def test_closing_the_iterator_aborts_within_a_step(core):
    async def test(engine: AsyncEngine) -> None:
        deltas = engine.generate("Tell me a long story.", SamplingParams(max_tokens=200, ignore_eos=True))
        first = await deltas.__anext__()
        assert first.token_ids
        await deltas.aclose()
        await wait_until_idle(engine)

    run(core, test)


def test_cancelling_before_the_first_token_aborts(core):
    async def test(engine: AsyncEngine) -> None:
        async def consume() -> None:
            async for _ in engine.generate(long_prompt(3), SamplingParams(max_tokens=50)):
                pass

        task = asyncio.create_task(consume())
        while engine.stats().num_running == 0:  # admitted, prefilling in 64-token chunks
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_until_idle(engine)

    run(core, test)


def test_bad_input_raises_and_allocates_nothing(core):
    async def test(engine: AsyncEngine) -> None:
        with pytest.raises(ValueError, match="^prompt: must not be empty"):
            await engine.tokenize("")
        with pytest.raises(ValueError, match="^prompt: give either"):
            await engine.tokenize("hi", messages=[{"role": "user", "content": "hi"}])
        with pytest.raises(ValueError, match="^messages\\[0\\].role"):
            await engine.tokenize(messages=[{"role": "robot", "content": "hi"}])
        with pytest.raises(ValueError, match="^prompt_token_ids"):
            await engine.add_request(await engine.tokenize([1, 10**9]), GREEDY)
        with pytest.raises(ValueError, match="^max_tokens: .*max_model_len"):
            await engine.add_request(await engine.tokenize("hi"), SamplingParams(max_tokens=10**6))
        await wait_until_idle(engine)

    run(core, test)


def test_full_waiting_queue_refuses_and_keeps_nothing(core):
    """max_num_seqs=1 and max_waiting_requests=3: one runs, three wait, the fifth is refused."""

    async def test(engine: AsyncEngine) -> None:
        params = SamplingParams(max_tokens=100, ignore_eos=True)
        streams = [await engine.add_request(await engine.tokenize(f"Story {i}:"), params) for i in range(4)]
        with pytest.raises(QueueFullError):
            await engine.add_request(await engine.tokenize("one too many"), params)
        for stream in streams:
            await stream.aclose()
        await wait_until_idle(engine)

    run(core, test)


def test_loop_thread_sleeps_when_idle(core):
    calls = []
    step = core.step

    def counting_step():
        calls.append(time.monotonic())
        return step()

    async def test(engine: AsyncEngine) -> None:
        core.step = counting_step
        try:
            [_ async for _ in engine.generate("Hello", SamplingParams(max_tokens=3, ignore_eos=True))]
            await wait_until_idle(engine)
            num_calls = len(calls)
            await asyncio.sleep(0.2)
            assert len(calls) == num_calls, "the loop stepped with nothing to do"
        finally:
            del core.step

    run(core, test)


def test_a_failing_step_ends_requests_with_engine_dead(core):
    def failing_step():
        raise RuntimeError("simulated kernel failure")

    async def test(engine: AsyncEngine) -> None:
        core.step = failing_step
        try:
            stream = await engine.add_request(await engine.tokenize("Hello"), GREEDY)
            with pytest.raises(EngineDeadError, match="simulated kernel failure"):
                await stream.__anext__()
            assert not engine.is_running
            with pytest.raises(EngineDeadError):
                await engine.add_request(await engine.tokenize("Hello"), GREEDY)
        finally:
            del core.step
            core.abort_request(stream.req_id)  # the dead loop left it queued

    run(core, test)


def test_the_event_loop_keeps_running_while_a_long_prompt_is_tokenized(core):
    text = long_prompt(400)  # about 35k tokens: tens of milliseconds of encoding

    async def test(engine: AsyncEngine) -> None:
        tokenizing = asyncio.create_task(engine.tokenize(text))
        num_ticks = 0
        while not tokenizing.done():
            await asyncio.sleep(0)
            num_ticks += 1
        assert len((await tokenizing).token_ids) > 30_000
        assert num_ticks > 20, "encoding held the GIL and stalled the event loop"  # typically ~1500

    run(core, test)


def test_tokenizer_is_safe_under_concurrent_encode_and_decode(core):
    """AsyncEngine encodes on two threads while the loop thread decodes: same results as alone."""
    tokenizer = core.tokenizer
    texts = SHORT_PROMPTS + [long_prompt(4), "emoji 🙂🚀 and 東京", "  spaces\tand\nlines  "]
    expected_ids = {text: tokenizer.encode(text) for text in texts}
    expected_texts = {text: tokenizer.decode(ids) for text, ids in expected_ids.items()}
    start = threading.Barrier(8)

    def work(worker: int) -> tuple[list[str], list[list[int]], list[str]]:
        order = (texts[worker % len(texts) :] + texts[: worker % len(texts)]) * 20
        start.wait()
        return (
            order,
            [tokenizer.encode(text) for text in order],
            [tokenizer.decode(expected_ids[t]) for t in order],
        )

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        for order, ids, decoded in pool.map(work, range(8)):
            assert ids == [expected_ids[text] for text in order]
            assert decoded == [expected_texts[text] for text in order]


PIN_SYSTEM_PROMPT = "You are a careful math tutor who explains each step of a calculation and checks it."


def test_cached_block_hashes_names_the_prompt_blocks_the_prefix_cache_holds(core):
    from firsttoken.core.hashing import extend_block_hashes

    async def test(engine: AsyncEngine) -> None:
        prompt = await engine.tokenize("A prompt no other test sends. " + long_prompt(1))
        block_hashes: list[bytes] = []
        extend_block_hashes(block_hashes, prompt.token_ids, engine.block_size, engine.hash_root)
        assert len(block_hashes) >= 3
        assert await engine.cached_block_hashes(block_hashes) == []
        stream = await engine.add_request(prompt, GREEDY)
        async for _ in stream:
            pass
        unknown = bytes(32)
        assert await engine.cached_block_hashes([unknown, *block_hashes]) == block_hashes

    run(core, test)


def test_a_pinned_system_prompt_is_reused_until_unpinned(core):
    conversation = [{"role": "system", "content": PIN_SYSTEM_PROMPT}, {"role": "user", "content": "2+2?"}]

    async def test(engine: AsyncEngine) -> None:
        pinned = await engine.pin_system_prompt(PIN_SYSTEM_PROMPT)
        assert pinned.num_tokens >= core.config.cache.block_size
        assert engine.pinned_prefixes() == (pinned,)
        assert await engine.pin_system_prompt(PIN_SYSTEM_PROMPT) == pinned
        deltas = [delta async for delta in engine.generate(messages=conversation, sampling_params=GREEDY)]
        assert deltas[-1].num_cached_tokens == pinned.num_tokens
        await engine.unpin_prefix(pinned.pin_id)
        assert engine.pinned_prefixes() == ()
        with pytest.raises(InvalidInputError, match="^pin_id: no pinned prefix"):
            await engine.unpin_prefix(pinned.pin_id)

    run(core, test)


def test_concurrent_pins_of_one_system_prompt_share_one_pin(core):
    async def test(engine: AsyncEngine) -> None:
        pins = await asyncio.gather(*(engine.pin_system_prompt(PIN_SYSTEM_PROMPT) for _ in range(3)))
        assert pins[0] == pins[1] == pins[2]
        assert engine.pinned_prefixes() == (pins[0],)
        await engine.unpin_prefix(pins[0].pin_id)

    run(core, test)


def test_a_system_prompt_too_short_or_too_long_to_pin_is_refused(core):
    async def test(engine: AsyncEngine) -> None:
        with pytest.raises(InvalidInputError, match="^system_prompt: renders to .* fewer than one KV block"):
            await engine.pin_system_prompt("Hi")
        with pytest.raises(InvalidInputError, match="^system_prompt: renders to .* at most"):
            await engine.pin_system_prompt("word " * core.max_request_tokens)
        assert engine.pinned_prefixes() == ()

    run(core, test)


def test_shutdown_during_a_pin_fails_it_and_frees_its_blocks(core):
    async def test(engine: AsyncEngine) -> None:
        pin = asyncio.create_task(engine.pin_system_prompt(long_prompt(3)))
        while engine.stats().num_running == 0:  # prefilling in 64-token chunks
            await asyncio.sleep(0.001)
        await engine.shutdown()
        with pytest.raises(EngineDeadError):
            await pin
        assert core.pinned_prefixes.resident == {}

    run(core, test)


def test_from_options_loads_the_model_off_the_callers_thread(monkeypatch):
    """Only the step loop's thread may keep an OpenMP pool (see AsyncEngine.from_options): the
    model must not load, warm up or pin on the caller's (the event loop's) thread."""
    from firsttoken.engine import async_engine

    loading_threads = []

    class RecordingTokenizer:
        def apply_chat_template(self, messages, add_generation_prompt):
            return messages[0]["content"]

        def encode(self, text):
            return [1, 2, 3]

    class RecordingCore:
        tokenizer = RecordingTokenizer()

        def pin_prefix_now(self, token_ids, pin_id):
            loading_threads.append(threading.current_thread())

    def build(config):
        loading_threads.append(threading.current_thread())
        return RecordingCore()

    monkeypatch.setattr(async_engine, "build_engine_core", build)
    monkeypatch.setattr(async_engine.AsyncEngine, "__init__", lambda self, core: None)
    async_engine.AsyncEngine.from_options("model.gguf", system_prompt="Be brief.")
    assert len(loading_threads) == 2
    assert all(thread is not threading.current_thread() for thread in loading_threads)


def test_from_options_raises_the_loaders_error_on_the_callers_thread(monkeypatch):
    from firsttoken.engine import async_engine
    from firsttoken.errors import InvalidInputError

    def refuse(config):
        raise InvalidInputError("model", "no such file")

    monkeypatch.setattr(async_engine, "build_engine_core", refuse)
    with pytest.raises(InvalidInputError, match="no such file"):
        async_engine.AsyncEngine.from_options("missing.gguf")


def test_a_grammar_is_compiled_once_off_the_loop_thread(core, monkeypatch):
    """The front end compiles it on a tokenizer thread and hands it to the core, which does not
    compile it again on the loop thread (where it would stall every running stream), even when
    the compiler's cache no longer holds it."""
    compiler = core.grammar_compiler
    compiling_threads = []
    compile_now = compiler.compile

    def counted_compile(structured):
        compiling_threads.append(threading.current_thread().name)
        compiler._compiled.clear()  # nothing for a second compile to find
        return compile_now(structured)

    monkeypatch.setattr(compiler, "compile", counted_compile)
    params = SamplingParams(
        temperature=0, max_tokens=8, structured_output=StructuredOutput(regex="[a-z]{3,6}")
    )

    async def test(engine: AsyncEngine) -> None:
        deltas = [delta async for delta in engine.generate("Name a colour:", params)]
        assert deltas[-1].finished

    run(core, test)
    assert len(compiling_threads) == 1 and compiling_threads[0].startswith("firsttoken-tokenize")


class _HeldExecution:
    """Wraps the core's executor: the first step's forward pass waits until `release()`."""

    def __init__(self, core: EngineCore, monkeypatch: pytest.MonkeyPatch) -> None:
        self.execute = core.executor.execute
        self.entered = threading.Event()
        self.released = threading.Event()
        monkeypatch.setattr(core.executor, "execute", self)

    def __call__(self, scheduler_output):
        self.entered.set()
        self.released.wait(timeout=60)
        return self.execute(scheduler_output)


def test_the_gauges_show_a_steps_work_while_it_runs(core, monkeypatch):
    held = _HeldExecution(core, monkeypatch)

    async def test(engine: AsyncEngine) -> None:
        metrics = PrometheusMetrics("m", engine.stats)
        stream = await engine.add_request(await engine.tokenize(long_prompt(2)), GREEDY)
        try:
            assert await asyncio.to_thread(held.entered.wait, 60)
            gauges = {
                sample.name: sample.value
                for family in text_string_to_metric_families(metrics.render().decode())
                for sample in family.samples
            }
            assert gauges["firsttoken:num_requests_running"] == 1
            assert gauges["firsttoken:num_requests_waiting"] == 0
            assert gauges["firsttoken:kv_cache_usage_perc"] > 0
        finally:
            held.released.set()
        assert [delta async for delta in stream][-1].finished

    run(core, test)
