"""AsyncEngine: the asyncio front end of one EngineCore, whose step loop runs in its own thread.

Requests, aborts and pins cross into the loop thread through an inbox drained at the top of
every step, so an abort frees its KV blocks within one step. Deltas cross back once per step with
`loop.call_soon_threadsafe` onto each request's asyncio queue. When no request is left, the
loop thread sleeps on the inbox's condition (no busy spin); torch releases the GIL inside its
kernels, so the HTTP side keeps serving while a step runs.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Protocol, Sequence, Union

from firsttoken.config import EngineConfig
from firsttoken.core.hashing import BlockHash
from firsttoken.engine.builder import build_engine_core
from firsttoken.engine.engine_core import EngineCore
from firsttoken.engine.futures import settle_future
from firsttoken.engine.pinned_prefixes import default_pin_id
from firsttoken.engine.prompt_encoder import (
    Messages,
    TextOrTokenIds,
    PromptEncoder,
    TokenizedPrompt,
    render_system_prompt,
)
from firsttoken.errors import EngineDeadError, InvalidInputError
from firsttoken.outputs import EngineCompute, EngineInspection, EngineStats, PinnedPrefix, RequestDelta
from firsttoken.sample.grammar import CompiledGrammar
from firsttoken.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_THREAD_POLL_S = 0.02


class RequestObserver(Protocol):
    """Sees every delta of every request on the asyncio thread (metrics)."""

    def on_delta(self, delta: RequestDelta, received_time: float, previous_token_time: float | None) -> None:
        """`received_time`: when the delta reached the asyncio thread; `previous_token_time`:
        when this request's previous token did (None before its first)."""


@dataclass(frozen=True)
class _AddCommand:
    """A tokenized request for the loop thread to add to the core."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    tokenized_time: float
    priority: int
    ttft_slo_ms: float | None
    # Its structured output's grammar, compiled on a tokenizer thread; None without one.
    grammar: CompiledGrammar | None


@dataclass(frozen=True)
class _AbortCommand:
    """A request for the loop thread to end now."""

    req_id: str


@dataclass(frozen=True)
class _PinCommand:
    """A prefix for the loop thread to compute and keep resident; `done` gets the pin."""

    pin_id: str
    token_ids: list[int]
    done: concurrent.futures.Future[PinnedPrefix]


@dataclass(frozen=True)
class _UnpinCommand:
    """A pinned prefix for the loop thread to release; `done` gets None or the error."""

    pin_id: str
    done: concurrent.futures.Future[None]


@dataclass(frozen=True)
class _CachedQuery:
    """Block hashes for the loop thread to look up in the prefix cache; `done` gets those held."""

    block_hashes: list[BlockHash]
    done: concurrent.futures.Future[list[BlockHash]]


_Command = Union[_AddCommand, _AbortCommand, _PinCommand, _UnpinCommand, _CachedQuery]


class _Inbox:
    """Owns the commands waiting for the loop thread, and wakes it when one arrives."""

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._commands: collections.deque[_Command] = collections.deque()
        self._closed = False

    def put(self, command: _Command) -> None:
        with self._condition:
            self._commands.append(command)
            self._condition.notify()

    def take_all(self, wait: bool) -> list[_Command] | None:
        """Every queued command (sleeping until one arrives if `wait`); None once closed."""
        with self._condition:
            while wait and not self._commands and not self._closed:
                self._condition.wait()
            if self._closed:
                return None
            commands = list(self._commands)
            self._commands.clear()
            return commands

    def close(self) -> None:
        with self._condition:
            self._closed = True
            self._condition.notify()


class RequestStream:
    """One request on the asyncio side: its admission, its queue of deltas, and when its
    tokens reached this thread (perf_counter seconds)."""

    def __init__(self, req_id: str, arrival_time: float, engine: AsyncEngine) -> None:
        self.req_id = req_id
        self.arrival_time = arrival_time
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.finished = False
        self._engine = engine
        self._admission: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queue: asyncio.Queue[RequestDelta | BaseException] = asyncio.Queue()
        self._ended = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestDelta:
        if self._ended:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self._ended = True
            raise item
        if item.finished:
            self._ended = True
        return item

    async def admitted(self) -> None:
        """Return once the engine accepted the request; raise what it rejected it with."""
        await self._admission

    async def aclose(self) -> None:
        """Abort the request unless it already finished (closing the stream early cancels it)."""
        self._ended = True
        if not self.finished:
            self._engine.abort(self.req_id)

    # -- called by AsyncEngine on the asyncio thread ------------------------------------------

    def _admit(self, error: BaseException | None) -> None:
        if self._admission.done():
            return
        if error is None:
            self._admission.set_result(None)
        else:
            self._admission.set_exception(error)

    def _deliver(self, delta: RequestDelta, now: float) -> float | None:
        """Queue a delta; returns when the previous token arrived."""
        previous = self.last_token_time
        if delta.token_ids:
            if self.first_token_time is None:
                self.first_token_time = now
            self.last_token_time = now
        self.finished = delta.finished
        self._queue.put_nowait(delta)
        return previous

    def _fail(self, error: BaseException) -> None:
        self.finished = True
        self._admit(error)
        self._queue.put_nowait(error)


class AsyncEngine:
    """Owns one EngineCore, the thread that steps it, the tokenizer executor and the
    asyncio-side streams of live requests."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.tokenizer = core.tokenizer
        self.model_path = core.model_path
        self.max_model_len = core.max_model_len
        self.compute: EngineCompute = core.compute
        self._inspection: EngineInspection = core.inspect()
        self.max_request_tokens = core.max_request_tokens
        self.vocab_size = core.worker.vocab_size
        self.block_size = core.config.cache.block_size
        # The parent of every request's first block hash (block hashes depend on it).
        self.hash_root = core.hash_root
        # Requests allowed to wait for admission (None: no limit); more raise QueueFullError.
        self.max_waiting_requests = core.config.scheduler.max_waiting_requests
        self._observers: list[RequestObserver] = []
        self._inbox = _Inbox()
        self._streams: dict[str, RequestStream] = {}
        self._stats = core.stats()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._dead: EngineDeadError | None = None
        self._encoder = PromptEncoder(self.tokenizer, self.vocab_size)

    @classmethod
    def from_options(
        cls, model: str | None = None, *, system_prompt: str | None = None, **engine_options: Any
    ) -> AsyncEngine:
        """Load a model with the same keywords as `LLM(...)`, pinning `system_prompt` (its chat
        template rendering) when given; call `start()` inside the event loop.

        The model loads on a thread that then exits, so that only the step loop's thread owns
        an OpenMP thread pool: libgomp keeps a pool per thread that ever ran a parallel region,
        and with more pooled threads than cores it stops spinning between regions, which slows
        every matmul of a decode step.
        """
        loaded: list[EngineCore] = []
        failure: list[BaseException] = []

        def load() -> None:
            try:
                core = build_engine_core(EngineConfig.from_kwargs(model=model, **engine_options))
                if system_prompt is not None:  # pinned before the step loop thread takes over
                    token_ids = core.tokenizer.encode(render_system_prompt(core.tokenizer, system_prompt))
                    core.pin_prefix_now(token_ids, "system-prompt")
                loaded.append(core)
            except BaseException as error:  # re-raised on the caller's thread
                failure.append(error)

        loader = threading.Thread(target=load, name="firsttoken-load")
        loader.start()
        loader.join()
        if failure:
            raise failure[0]
        return cls(loaded[0])

    # -- life cycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        """Bind to the running event loop and start the step loop thread."""
        if self._thread is not None:
            raise RuntimeError("AsyncEngine: already started")
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run_loop, name="firsttoken-engine", daemon=True)
        self._thread.start()
        # The grammar engine's view of the vocabulary, built now on a tokenizer thread
        # rather than by the first structured-output request.
        self._encoder.submit(self.core.grammar_compiler.engine_tokenizer)

    async def shutdown(self) -> None:
        """Stop the loop thread; live requests end with EngineDeadError at once, not after the
        step the thread is running. Cancelling this while it waits for that step leaves the
        (daemon) thread to finish on its own: a server's shutdown deadline is kept."""
        self._inbox.close()
        self._fail_all(EngineDeadError("the engine was shut down"))
        self._encoder.shutdown()
        if self._thread is not None:
            # Polled rather than joined on an executor thread, which asyncio.run would wait for
            # at exit even after this coroutine was cancelled.
            while self._thread.is_alive():
                await asyncio.sleep(_THREAD_POLL_S)
        self.core.shutdown()

    def add_observer(self, observer: RequestObserver) -> None:
        """Show every future delta to `observer` (on the asyncio thread, as it arrives)."""
        self._observers.append(observer)

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._dead is None

    # -- requests ------------------------------------------------------------------------------

    async def tokenize(
        self,
        prompt: TextOrTokenIds | None = None,
        *,
        messages: Messages | None = None,
        add_generation_prompt: bool = True,
        add_special_tokens: bool = True,
        chat_template_args: dict[str, Any] | None = None,
    ) -> TokenizedPrompt:
        """Stamp arrival, then render the chat template (for `messages`) and encode, timed, off
        the event loop (PromptEncoder.tokenize). `chat_template_args`: the keyword arguments of
        Tokenizer.apply_chat_template (tools, documents, template_kwargs)."""
        return await self._encoder.tokenize(
            prompt,
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            add_special_tokens=add_special_tokens,
            chat_template_args=chat_template_args,
        )

    async def detokenize(self, token_ids: Sequence[int]) -> str:
        """The text of token ids (special tokens included), decoded on the tokenizer threads."""
        return await self._encoder.detokenize(token_ids)

    async def add_request(
        self,
        prompt: TokenizedPrompt,
        sampling_params: SamplingParams,
        *,
        priority: int = 0,
        ttft_slo_ms: float | None = None,
        req_id: str | None = None,
    ) -> RequestStream:
        """Queue a tokenized request; returns once the engine accepted it.

        A structured-output constraint is compiled first, on the tokenizer threads.
        Raises InvalidInputError for bad input, QueueFullError when the waiting queue is full and
        EngineDeadError when the loop is gone; in each case nothing stays allocated.
        """
        if self._loop is None:
            raise RuntimeError("AsyncEngine: call start() first")
        if self._dead is not None:
            raise self._dead
        # Refused here, on the asyncio thread: the loop thread would only see it after the step
        # it is running (a long prefill may take seconds).
        self.core.validate_request(prompt.token_ids, sampling_params)
        grammar = None
        if sampling_params.structured_output is not None:
            # Compiled here, on a tokenizer thread, not on the loop thread that steps the other
            # requests; the core's add_request takes it as it is. A bad schema raises here.
            grammar = await self._encoder.run(self.core.compile_grammar, sampling_params.structured_output)
        req_id = req_id or self.core.new_req_id()
        if req_id in self._streams:
            raise InvalidInputError("req_id", f"{req_id!r} is already in use")
        stream = RequestStream(req_id, prompt.arrival_time, self)
        self._streams[req_id] = stream
        self._inbox.put(
            _AddCommand(
                req_id,
                prompt.token_ids,
                sampling_params,
                prompt.arrival_time,
                prompt.tokenized_time,
                priority,
                ttft_slo_ms,
                grammar,
            )
        )
        try:
            await stream.admitted()
        except asyncio.CancelledError:
            self.abort(req_id)
            raise
        return stream

    async def generate(
        self,
        prompt: TextOrTokenIds | None = None,
        sampling_params: SamplingParams | None = None,
        *,
        messages: Messages | None = None,
        priority: int = 0,
        ttft_slo_ms: float | None = None,
        req_id: str | None = None,
    ) -> AsyncIterator[RequestDelta]:
        """The request's deltas as they are produced; closing or cancelling the iterator aborts it.

        Give `prompt` (text or token ids) or `messages` (rendered with the chat template).
        """
        tokenized = await self.tokenize(prompt, messages=messages)
        stream = await self.add_request(
            tokenized,
            sampling_params or SamplingParams(),
            priority=priority,
            ttft_slo_ms=ttft_slo_ms,
            req_id=req_id,
        )
        try:
            async for delta in stream:
                yield delta
        finally:
            await stream.aclose()

    def abort(self, req_id: str) -> None:
        """End a request; its blocks are freed at the top of the next engine step."""
        if req_id in self._streams:
            self._inbox.put(_AbortCommand(req_id))

    # -- pinned prefixes -----------------------------------------------------------------------

    @property
    def can_pin(self) -> bool:
        """Whether prefixes can be pinned at all (they live in the prompt cache)."""
        return self.core.config.prompt_cache.enable

    async def pin_system_prompt(self, system_prompt: str) -> PinnedPrefix:
        """Keep the KV of a system message's chat-template rendering resident, as
        LLM.pin_system_prompt does; returns once it is computed. The pin is named by its tokens,
        so pinning the same system prompt again returns the same pin.

        Raises InvalidInputError (field `system_prompt`) when the rendering is shorter than one KV
        block, QueueFullError and EngineDeadError as add_request does.
        """
        token_ids = await self._encoder.encode_system_prompt(system_prompt)
        self._check_pinnable(len(token_ids))
        done: concurrent.futures.Future[PinnedPrefix] = concurrent.futures.Future()
        self._send(_PinCommand(default_pin_id(token_ids), token_ids, done))
        return await asyncio.wrap_future(done)

    async def unpin_prefix(self, pin_id: str) -> None:
        """Release a pinned prefix; raises InvalidInputError (field `pin_id`) if there is none."""
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._send(_UnpinCommand(pin_id, done))
        await asyncio.wrap_future(done)

    def pinned_prefixes(self) -> tuple[PinnedPrefix, ...]:
        """The pinned prefixes as of the latest pin or unpin."""
        return self.core.pinned_prefixes.snapshot

    def _check_pinnable(self, num_tokens: int) -> None:
        block_size = self.core.config.cache.block_size
        if num_tokens < block_size:
            raise InvalidInputError(
                "system_prompt",
                f"renders to {num_tokens} tokens, fewer than one KV block ({block_size}); nothing to pin",
            )
        if num_tokens >= self.max_request_tokens:  # computing it samples one token after it
            raise InvalidInputError(
                "system_prompt",
                f"renders to {num_tokens} tokens; a request here holds at most {self.max_request_tokens}",
            )

    async def cached_block_hashes(self, block_hashes: Sequence[BlockHash]) -> list[BlockHash]:
        """Those of `block_hashes` whose KV the prefix cache holds now, answered by the loop
        thread between two steps (a router asks which prefixes this engine still has)."""
        done: concurrent.futures.Future[list[BlockHash]] = concurrent.futures.Future()
        self._send(_CachedQuery(list(block_hashes), done))
        return await asyncio.wrap_future(done)

    def _send(self, command: _PinCommand | _UnpinCommand | _CachedQuery) -> None:
        if self._loop is None:
            raise RuntimeError("AsyncEngine: call start() first")
        if self._dead is not None:
            raise self._dead
        self._inbox.put(command)

    def stats(self) -> EngineStats:
        """The engine's gauges and counters (a consistent snapshot) as of the latest step's
        schedule or end: a step's requests and KV blocks show while it runs."""
        return self._stats

    def inspect(self) -> EngineInspection:
        """What the engine was built with (fixed at start, so read without the loop thread)."""
        return self._inspection

    # -- the loop thread -----------------------------------------------------------------------

    def _run_loop(self) -> None:
        core = self.core
        pins = core.pinned_prefixes
        live: set[str] = set()  # requests this loop added to the core and that have not ended
        core.on_scheduled = self._publish_stats
        try:
            while True:
                commands = self._inbox.take_all(wait=not core.has_unfinished_requests())
                if commands is None:
                    break
                if commands:
                    self._apply(commands, live)
                if core.has_unfinished_requests():
                    deltas = core.step()
                    live.difference_update(delta.req_id for delta in deltas if delta.finished)
                    self._publish_stats()
                    if deltas:
                        self._post(self._deliver, deltas)
                else:
                    self._publish_stats()
        except Exception as error:
            logger.exception("the engine loop stopped")
            dead = EngineDeadError(f"the engine loop stopped: {error!r}")
            pins.fail_waiters(dead)
            self._post(self._fail_all, dead)
            return
        finally:
            core.on_scheduled = None
        # Shut down: leave the core with no request and every block free.
        pins.fail_waiters(EngineDeadError("the engine was shut down"))
        for req_id in [*live, *pins.computing_req_ids]:
            core.abort_request(req_id)
        self._publish_stats()

    def _publish_stats(self) -> None:
        """Take a snapshot of the core's stats for `stats()` (on the loop thread, between phases
        of a step, so that it is consistent); a reference assignment, so readers on other
        threads see the old snapshot or the new one whole."""
        self._stats = self.core.stats()

    def _apply(self, commands: list[_Command], live: set[str]) -> None:
        admissions: list[tuple[str, BaseException | None]] = []
        closing: list[RequestDelta] = []
        for command in commands:
            if isinstance(command, _PinCommand):
                self._pin(command)
                continue
            if isinstance(command, _UnpinCommand):
                self._unpin(command)
                continue
            if isinstance(command, _CachedQuery):
                settle_future(command.done, self.core.cached_block_hashes(command.block_hashes))
                continue
            if isinstance(command, _AbortCommand):
                live.discard(command.req_id)
                delta = self.core.abort_request(command.req_id)
                if delta is not None:
                    closing.append(delta)
                continue
            try:
                self.core.add_request(
                    command.req_id,
                    command.prompt_token_ids,
                    command.sampling_params,
                    command.arrival_time,
                    command.tokenized_time,
                    command.priority,
                    command.ttft_slo_ms,
                    command.grammar,
                )
                live.add(command.req_id)
                admissions.append((command.req_id, None))
            except Exception as error:  # ValueError, QueueFullError: the caller's to handle
                admissions.append((command.req_id, error))
        if admissions or closing:
            self._post(self._answer_admissions, admissions, closing)

    def _pin(self, command: _PinCommand) -> None:
        """Answer at once if the prefix is already pinned, join a pin under way, or start one;
        the pin's waiters get it at the end of the step that computes it."""
        pins = self.core.pinned_prefixes
        existing = pins.resident_pin(command.pin_id, command.token_ids)
        if existing is not None:
            settle_future(command.done, existing)
            return
        if pins.wait_for(command.pin_id, command.done):
            return
        try:
            self.core.pin_prefix(command.token_ids, command.pin_id)
        except Exception as error:  # ValueError, QueueFullError: the caller's to handle
            settle_future(command.done, error=error)
            return
        pins.wait_for(command.pin_id, command.done)

    def _unpin(self, command: _UnpinCommand) -> None:
        try:
            self.core.pinned_prefixes.unpin(command.pin_id)
        except InvalidInputError as error:
            settle_future(command.done, error=error)
            return
        settle_future(command.done)

    def _post(self, callback: Any, *args: Any) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:
            logger.debug("event loop closed; dropping %s", callback.__name__)

    # -- the asyncio thread --------------------------------------------------------------------

    def _answer_admissions(
        self, admissions: list[tuple[str, BaseException | None]], closing: list[RequestDelta]
    ) -> None:
        """Admit or refuse each request the loop thread tried to add; deliver the closing
        deltas of those it aborted."""
        for req_id, error in admissions:
            stream = self._streams.get(req_id)
            if stream is None:
                continue
            if error is not None:
                del self._streams[req_id]
            stream._admit(error)
        self._deliver(closing)

    def _deliver(self, deltas: list[RequestDelta]) -> None:
        now = time.perf_counter()
        for delta in deltas:
            stream = self._streams.get(delta.req_id)
            if stream is None:
                continue
            previous_token_time = stream._deliver(delta, now)
            for observer in self._observers:
                observer.on_delta(delta, now, previous_token_time)
            if delta.finished:
                del self._streams[delta.req_id]

    def _fail_all(self, error: EngineDeadError) -> None:
        self._dead = error
        for stream in self._streams.values():
            stream._fail(error)
        self._streams.clear()
