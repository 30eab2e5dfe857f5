"""The engines `bench compare` times on the same prompt token ids: firsttoken, transformers, llama.cpp.

Every peer is timed the same way: from handing over the prompt's token ids to holding the
first generated token (TTFT), then until the last of `output_len` tokens (decode rate over
the tokens after the first). Generation is greedy and runs past EOS, so each peer does the
same amount of work.
"""

from __future__ import annotations

import importlib.util
import os
import time
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from firsttoken.engine.llm import LLM
from firsttoken.models.loaders.hf_folder import is_hf_folder
from firsttoken.sampling_params import SamplingParams


@dataclass(frozen=True)
class PeerTiming:
    """One request through one peer: seconds to the first token and the decode rate after it."""

    ttft_s: float
    decode_tokens_per_s: float | None  # None when only one token was generated


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def timing_from(start: float, first: float, end: float, num_tokens: int) -> PeerTiming:
    decode = (num_tokens - 1) / (end - first) if num_tokens > 1 and end > first else None
    return PeerTiming(first - start, decode)


class Peer(Protocol):
    name: str
    note: str

    def time_prompt(self, prompt_ids: list[int], output_len: int) -> PeerTiming: ...


class FirsttokenPeer:
    """firsttoken's LLM with the prompt cache off, so every prompt is prefilled in full."""

    name = "firsttoken"

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self.note = llm.inspect().dtype

    def time_prompt(self, prompt_ids: list[int], output_len: int) -> PeerTiming:
        params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
        start = time.perf_counter()
        first = None
        num_tokens = 0
        for delta in self.llm.stream(prompt_ids, params):
            if delta.token_ids and first is None:
                first = time.perf_counter()
            num_tokens += len(delta.token_ids)
        return timing_from(start, first, time.perf_counter(), num_tokens)


class TransformersPeer:
    """transformers' own loader and Llama implementation on the same checkpoint and dtype."""

    name = "transformers"

    def __init__(self, model: Any) -> None:
        self.model = model.eval()
        self.note = f"{_dtype_name(model.dtype)}, {torch.get_num_threads()} threads"

    @classmethod
    def load(cls, model_path: str, dtype_name: str) -> TransformersPeer:
        """Load a GGUF file (transformers dequantizes it) or a Hugging Face folder in the dtype
        named (e.g. "float32")."""
        if importlib.util.find_spec("transformers") is None:
            raise ValueError("compare: transformers is not installed; `pip install -e '.[dev]'` brings it")
        from transformers import AutoModelForCausalLM

        dtype = getattr(torch, dtype_name)
        if is_hf_folder(model_path):
            return cls(AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype))
        folder, file_name = os.path.split(model_path)
        return cls(AutoModelForCausalLM.from_pretrained(folder, gguf_file=file_name, dtype=dtype))

    def time_prompt(self, prompt_ids: list[int], output_len: int) -> PeerTiming:
        stamps = _TokenStamps()
        input_ids = torch.tensor([prompt_ids])
        start = time.perf_counter()
        with torch.inference_mode():
            self.model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=output_len,
                min_new_tokens=output_len,
                do_sample=False,
                streamer=stamps,
            )
        return timing_from(start, stamps.first, time.perf_counter(), stamps.num_tokens)


class _TokenStamps:
    """A transformers streamer that only notes when generated tokens arrive.

    generate() hands the prompt to put() first, then each new token; end() closes the stream.
    """

    def __init__(self) -> None:
        self.prompt_seen = False
        self.first: float | None = None
        self.num_tokens = 0

    def put(self, token_ids: torch.Tensor) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        if self.first is None:
            self.first = time.perf_counter()
        self.num_tokens += token_ids.numel()

    def end(self) -> None:
        return None


def llama_cpp_available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


class LlamaCppPeer:
    """llama.cpp through llama-cpp-python on the GGUF file itself (its own quantized weights)."""

    name = "llama.cpp"

    def __init__(self, gguf_path: str, context_len: int) -> None:
        from llama_cpp import Llama

        threads = torch.get_num_threads()
        self.model: Any = Llama(
            model_path=gguf_path, n_ctx=context_len, n_batch=context_len, n_threads=threads, verbose=False
        )
        self.eos_bias = {self.model.token_eos(): float("-inf")}  # run past EOS, as the others do
        self.note = f"GGUF weights as stored, {threads} threads"

    def time_prompt(self, prompt_ids: list[int], output_len: int) -> PeerTiming:
        self.model.reset()  # llama-cpp-python reuses a matching prefix of the last prompt otherwise
        start = time.perf_counter()
        first = None
        num_tokens = 0
        for _ in self.model.create_completion(
            prompt_ids, max_tokens=output_len, temperature=0.0, stream=True, logit_bias=self.eos_bias
        ):
            if first is None:
                first = time.perf_counter()
            num_tokens += 1
        return timing_from(start, first, time.perf_counter(), num_tokens)
