"""LLM: the offline Python API (`from firsttoken import LLM`)."""

from __future__ import annotations

import time
from typing import Any, Iterator, Mapping, Sequence, Union

from firsttoken.config import EngineConfig
from firsttoken.engine.builder import build_engine_core
from firsttoken.engine.pinned_prefixes import default_pin_id
from firsttoken.engine.prompt_encoder import render_system_prompt
from firsttoken.errors import InvalidInputError
from firsttoken.outputs import (
    EngineCompute,
    EngineInspection,
    EngineStats,
    PinnedPrefix,
    RequestDelta,
    RequestOutput,
)
from firsttoken.sampling_params import SamplingParams

Messages = Sequence[dict[str, Any]]
# A prompt is text, or as vLLM takes it a dict: {"prompt": text} or {"prompt_token_ids": ids}.
OfflinePrompt = Union[str, Mapping[str, Any]]
PromptInput = Union[OfflinePrompt, Sequence[OfflinePrompt], None]
PROMPT_KEYS = ("prompt", "prompt_token_ids")


class LLM:
    """Owns one EngineCore (`core`) and generates from prompts in this process, driving its
    step loop on the caller's thread until done.

    `LLM()` loads the embedded default model; `LLM(path)` a GGUF file or Hugging Face folder.
    Every engine option is a keyword (`LLM(dtype="float32", block_size=32)`), or pass whole
    config sections (`LLM(prompt_cache=PromptCacheConfig(enable=False))`).
    """

    def __init__(self, model: str | None = None, **engine_options: Any) -> None:
        self.core = build_engine_core(EngineConfig.from_kwargs(model=model, **engine_options))
        self.config = self.core.config  # as resolved against the checkpoint
        self.tokenizer = self.core.tokenizer

    def generate(
        self,
        prompts: PromptInput = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in input order."""
        requests = self._prepare(prompts, prompt_token_ids, sampling_params, priority)
        outputs = {req_id: output for req_id, output in requests}
        self._run_until_done(outputs)
        return list(outputs.values())

    def chat(
        self,
        messages: Messages | Sequence[Messages],
        sampling_params: SamplingParams | None = None,
    ) -> RequestOutput | list[RequestOutput]:
        """Apply the model's chat template and generate; one conversation or a list of them."""
        is_batch = bool(messages) and isinstance(messages[0], (list, tuple))
        conversations = list(messages) if is_batch else [messages]
        prompts = [self.tokenizer.apply_chat_template(conversation) for conversation in conversations]
        outputs = self.generate(prompts, sampling_params)
        return outputs if is_batch else outputs[0]

    def stream(
        self, prompt: str | Sequence[int], sampling_params: SamplingParams | None = None
    ) -> Iterator[RequestDelta]:
        """Deltas of one request as they are produced; closing the iterator aborts it."""
        is_text = isinstance(prompt, str)
        (req_id, _), = self._prepare(
            [prompt] if is_text else None, None if is_text else [prompt], sampling_params, None
        )
        finished = False
        try:
            while not finished:
                for delta in self.core.step():
                    if delta.req_id == req_id:
                        finished = delta.finished
                        yield delta
        finally:
            if not finished:
                self.core.abort_request(req_id)

    def pin_prefix(self, prefix: str | Sequence[int], pin_id: str | None = None) -> PinnedPrefix:
        """Compute a prefix (text or token ids) once and keep its KV resident until unpinned.

        Requests that start with it reuse every full block of it. With a prompt-cache
        `persist_dir` the KV is also saved and restored by the next engine start.
        """
        token_ids = self.tokenizer.encode(prefix) if isinstance(prefix, str) else list(prefix)
        return self.core.pin_prefix_now(token_ids, pin_id or default_pin_id(token_ids))

    def pin_system_prompt(self, system_prompt: str, pin_id: str | None = None) -> PinnedPrefix:
        """Pin the chat-template rendering of a system message: the prefix of every
        conversation that starts with it."""
        return self.pin_prefix(render_system_prompt(self.tokenizer, system_prompt), pin_id)

    def unpin_prefix(self, pin_id: str) -> None:
        self.core.pinned_prefixes.unpin(pin_id)

    def pinned_prefixes(self) -> list[PinnedPrefix]:
        return list(self.core.pinned_prefixes.resident.values())

    def reset_prefix_cache(self) -> None:
        """Forget every cached and pinned prefix."""
        self.core.reset_prefix_cache()

    def stats(self) -> EngineStats:
        return self.core.stats()

    @property
    def compute(self) -> EngineCompute:
        """The dtype and batch invariance chosen at start, and why (measured where asked "auto")."""
        return self.core.compute

    def inspect(self) -> EngineInspection:
        """What this engine was built with: the model, the kernels chosen at start, the KV cache."""
        return self.core.inspect()

    def shutdown(self) -> None:
        """Stop the tensor-parallel ranks' processes now (they also stop when this LLM is
        garbage collected, or at exit); nothing to do with one rank."""
        self.core.shutdown()

    def _prepare(
        self,
        prompts: PromptInput,
        prompt_token_ids: Sequence[Sequence[int]] | None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        priority: Sequence[int] | None,
    ) -> list[tuple[str, RequestOutput]]:
        """Tokenize and queue every prompt; if one is rejected, none stays queued."""
        texts, token_lists = _normalize_prompts(prompts, prompt_token_ids)
        count = len(texts)
        params_list = _per_prompt(sampling_params or SamplingParams(), count, "sampling_params")
        priorities = _per_prompt(list(priority) if priority is not None else 0, count, "priority")
        queued: list[tuple[str, RequestOutput]] = []
        try:
            for text, token_ids, params, request_priority in zip(texts, token_lists, params_list, priorities):
                arrival = time.perf_counter()
                if token_ids is None:
                    token_ids = self.tokenizer.encode(text)
                req_id = self.core.new_req_id()
                self.core.add_request(
                    req_id, list(token_ids), params, arrival, time.perf_counter(), request_priority
                )
                queued.append((req_id, RequestOutput(req_id, text, list(token_ids))))
        except Exception:
            for req_id, _ in queued:
                self.core.abort_request(req_id)
            raise
        return queued

    def _run_until_done(self, outputs: dict[str, RequestOutput]) -> None:
        remaining = set(outputs)
        try:
            while remaining:
                for delta in self.core.step():
                    output = outputs.get(delta.req_id)
                    if output is None:
                        continue
                    output.add(delta)
                    if delta.finished:
                        remaining.discard(delta.req_id)
        finally:
            for req_id in remaining:
                self.core.abort_request(req_id)


def _normalize_prompts(
    prompts: PromptInput, prompt_token_ids: Sequence[Sequence[int]] | None
) -> tuple[list[str | None], list[list[int] | None]]:
    if (prompts is None) == (prompt_token_ids is None):
        raise InvalidInputError("prompts", "give either prompts or prompt_token_ids")
    if prompts is not None:
        entries = [prompts] if isinstance(prompts, (str, Mapping)) else list(prompts)
        parsed = [_parse_prompt(index, entry) for index, entry in enumerate(entries)]
        return [text for text, _ in parsed], [ids for _, ids in parsed]
    token_lists = [list(ids) for ids in prompt_token_ids]
    for index, ids in enumerate(token_lists):
        if not ids:
            raise InvalidInputError(f"prompt_token_ids[{index}]", "must not be empty")
    return [None] * len(token_lists), token_lists


def _parse_prompt(index: int, entry: Any) -> tuple[str | None, list[int] | None]:
    """(text, None) or (None, token ids) from one entry of `prompts`."""
    field_name = f"prompts[{index}]"
    if isinstance(entry, Mapping):
        if len(entry) != 1 or next(iter(entry)) not in PROMPT_KEYS:
            raise InvalidInputError(
                field_name,
                f"a prompt dict holds one key of {PROMPT_KEYS}, got {sorted(map(str, entry))}",
            )
        if "prompt" not in entry:
            ids = entry["prompt_token_ids"]
            if isinstance(ids, (str, bytes, Mapping)) or not isinstance(ids, Sequence) or not ids:
                raise InvalidInputError(
                    f"{field_name}.prompt_token_ids", "must be a non-empty list of token ids"
                )
            return None, list(ids)
        entry = entry["prompt"]
        field_name = f"{field_name}.prompt"
    if not isinstance(entry, str) or not entry:
        raise InvalidInputError(field_name, "must be a non-empty string")
    return entry, None


def _per_prompt(value: Any, count: int, field_name: str) -> list[Any]:
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            raise InvalidInputError(field_name, f"got {len(value)} values for {count} prompts")
        return list(value)
    return [value] * count
