"""Structured output: grammars compiled by llguidance over this model's vocabulary, a matcher per
constrained request, and the token masks of a step's constrained rows.

Engine. llguidance, chosen over xgrammar by benchmarks/grammar_engines.py on this tokenizer: it
compiles a JSON schema several times faster (what a request with a new schema waits before its
first token), its per-token masks cost more but stay well under 1% of a decode step, and it
needs neither transformers nor torch at run time.

Vocabulary. The engine sees our tokenizer's own view (tokenizer.py): each token's bytes, the
special tokens (never allowed inside a grammar) and the end-of-sequence ids (allowed where the
grammar may end), so it works for every tokenizer we load, GGUF ones included.

Life of a constraint. The front end compiles a request's grammar when it arrives, on its
tokenizer threads, so compiling overlaps other work and a bad schema is a 400 before anything
is queued; compiled grammars are cached by constraint, and a request takes a copy of its
grammar's start matcher. The sampler owns that matcher (a tracked request: logits_processors.py)
and advances it with each generated token as it comes back as a step input, so preemption,
recomputes and aborted draws never desynchronise it. Before a constrained row is sampled its
mask is filled from the matcher and every token outside it gets -inf; rows without a
constraint are untouched, and a step without one runs nothing here. Where the grammar is
complete the mask allows only end-of-sequence, so the request ends there.

The masks are filled when the rows are sampled, not on another thread while the forward runs:
filling 8 rows took ~60 us here (applying them ~160 us), about what handing the work to a
thread and joining it costs, against a forward of 10 ms and more.
"""

from __future__ import annotations

import collections
import json
import logging
import sys
import threading
from dataclasses import dataclass
from typing import Sequence

import llguidance
import torch

from firsttoken.arithmetic import ceil_div
from firsttoken.errors import InvalidInputError
from firsttoken.sample.ascii_classes import ascii_classes, ascii_schema_patterns
from firsttoken.sampling_params import StructuredOutput
from firsttoken.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

_BITS = 32  # tokens per bitmask word
assert sys.byteorder == "little", "apply_bitmask reads the mask's int32 words as little-endian bytes"
DEFAULT_CACHE_SIZE = 256  # compiled grammars kept, least recently used dropped first
# JSON as json.dumps writes it: one space after "," and ":", no other whitespace. A small model
# allowed any whitespace can spend its tokens on newlines and indents (a schema's "x-guidance"
# options override this).
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class CompiledGrammar:
    """A grammar compiled for this vocabulary: a matcher at its start, never advanced itself
    (each request takes a copy), and the vocabulary's end-of-sequence ids."""

    start: llguidance.LLMatcher
    end_token_ids: tuple[int, ...]

    def new_state(self) -> GrammarState:
        return GrammarState(self.start.deep_copy(), self.end_token_ids)


@dataclass(frozen=True)
class GrammarState:
    """Where one request's output stands in its grammar: its own matcher, advanced by each
    generated token."""

    matcher: llguidance.LLMatcher
    end_token_ids: tuple[int, ...]

    def advance(self, token_ids: list[int]) -> None:
        # A token its mask allowed always advances it; a failure leaves it in an error state,
        # which fill_bitmask turns into "end here". A finished grammar (ignore_eos draws past its
        # end) takes nothing more: the ends it allows there are no failure.
        if self.matcher.is_stopped():
            return
        self.matcher.consume_tokens(token_ids)

    def error(self) -> str | None:
        """Why the matcher failed (its first line), or None while it has not."""
        return _first_line(self.matcher.get_error()) if self.matcher.is_error() else None

    def fill(self, bitmask_row: torch.Tensor) -> None:
        """The next token's mask into bitmask_row [W] int32 (zeroed). A finished grammar (its
        end already drawn and kept, as with ignore_eos) or a failed one allows only
        end-of-sequence, so a row never has no token to draw."""
        matcher = self.matcher
        if matcher.is_error():
            logger.warning("structured output: the grammar matcher failed (%s); ending the request",
                           _first_line(matcher.get_error()))
        if matcher.is_error() or matcher.is_stopped():
            for token_id in self.end_token_ids:
                bitmask_row[token_id // _BITS] |= _bit(token_id)
            return
        matcher.unsafe_compute_mask_ptr(
            bitmask_row.data_ptr(), bitmask_row.numel() * bitmask_row.element_size()
        )


class _VocabularyView:
    """What llguidance asks of a tokenizer: each token's bytes, special ids, end-of-sequence ids,
    and encoding text into ids."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        special_token_ids = set(tokenizer.backend.get_added_tokens_decoder())
        num_tokens = min(tokenizer.vocab_size, vocab_size)
        self.tokens = [tokenizer.token_bytes(token_id) for token_id in range(num_tokens)]
        # Ids past the tokenizer's (a model's padded vocabulary) stand for nothing: special.
        self.tokens.extend(b"" for _ in range(num_tokens, vocab_size))
        self.special_token_ids = sorted(special_token_ids | set(range(num_tokens, vocab_size)))
        self.eos_token_id = min(tokenizer.eos_token_ids) if tokenizer.eos_token_ids else None
        self.bos_token_id = tokenizer.bos_token_id
        self._tokenizer = tokenizer

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):  # llguidance probes with bytes first; text is what we encode
            raise TypeError("encodes text")
        return self._tokenizer.encode(text, add_special_tokens=False)


class GrammarCompiler:
    """Owns the grammar engine's view of the vocabulary (built on first use: ~0.1 s) and the
    compiled grammars by constraint, least recently used dropped first. Safe across threads."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, cache_size: int = DEFAULT_CACHE_SIZE) -> None:
        self.vocab_size = vocab_size
        self._tokenizer = tokenizer
        self._cache_size = cache_size
        self._engine_tokenizer: llguidance.LLTokenizer | None = None
        self._compiled: collections.OrderedDict[tuple[object, ...], CompiledGrammar] = (
            collections.OrderedDict()
        )
        self._lock = threading.Lock()

    def engine_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._engine_tokenizer is None:
                view = _VocabularyView(self._tokenizer, self.vocab_size)
                eos_token_ids = sorted(self._tokenizer.eos_token_ids)
                self._engine_tokenizer = llguidance.LLTokenizer(
                    llguidance.TokenizerWrapper(view), n_vocab=self.vocab_size, eos_token=eos_token_ids
                )
            return self._engine_tokenizer

    def compile(self, structured: StructuredOutput) -> CompiledGrammar:
        """The constraint's grammar; raises InvalidInputError naming its field when the schema,
        regular expression or grammar is not valid."""
        key = structured.key
        with self._lock:
            compiled = self._compiled.get(key)
            if compiled is not None:
                self._compiled.move_to_end(key)
                return compiled
        # Compiled outside the lock (llguidance drops the GIL while compiling): two threads
        # compiling one new grammar at once both compile it, and one copy stays.
        compiled = CompiledGrammar(
            self._start_matcher(structured), tuple(sorted(self._tokenizer.eos_token_ids))
        )
        with self._lock:
            self._compiled[key] = compiled
            self._compiled.move_to_end(key)
            while len(self._compiled) > self._cache_size:
                self._compiled.popitem(last=False)
        return compiled

    def _start_matcher(self, structured: StructuredOutput) -> llguidance.LLMatcher:
        try:
            grammar_format, text = _grammar_source(structured)
            if grammar_format == "json_schema":
                grammar = llguidance.LLMatcher.grammar_from_json_schema(text, defaults=JSON_STYLE)
            else:
                grammar = llguidance.grammar_from(grammar_format, text)
        except ValueError as error:
            raise InvalidInputError(structured.field, str(error)) from None
        matcher = llguidance.LLMatcher(self.engine_tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise InvalidInputError(structured.field, _first_line(matcher.get_error()))
        # A grammar that matches nothing (a `$ref` loop) compiles, and fails at its first mask:
        # found here it is the caller's error, not an empty "stop" after generation started.
        probe = matcher.deep_copy()
        probe.compute_bitmask()
        if probe.is_error():
            raise InvalidInputError(
                structured.field, f"no output can satisfy it ({_first_line(probe.get_error())})"
            )
        return matcher


def _grammar_source(structured: StructuredOutput) -> tuple[str, str]:
    """(llguidance's format name, text) of a constraint."""
    if structured.json_schema is not None:
        return "json_schema", _with_ascii_patterns(structured.json_schema, structured.field)
    if structured.json_object:
        return "json_schema", '{"type": "object"}'
    if structured.regex is not None:
        return "regex", ascii_classes(structured.regex)
    if structured.choice is not None:
        # A Lark alternation of JSON-quoted literals: no option's characters mean anything.
        return "lark", "start: " + " | ".join(json.dumps(option) for option in structured.choice)
    assert structured.grammar is not None
    return "grammar", structured.grammar  # Lark, or GBNF converted to Lark


def _with_ascii_patterns(schema_text: str, field: str) -> str:
    if "pattern" not in schema_text:
        return schema_text
    try:
        schema = json.loads(schema_text)
    except (ValueError, RecursionError):
        raise InvalidInputError(field, "is not valid JSON, or nests too deep") from None
    return json.dumps(ascii_schema_patterns(schema))


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else "invalid grammar"


def fill_bitmask(states: Sequence[GrammarState], vocab_size: int) -> torch.Tensor:
    """Token masks [n, ceil(V / 32)] int32 on the host, bit t of a row set where token t may come
    next in its request's grammar."""
    bitmask = torch.zeros(len(states), ceil_div(vocab_size, _BITS), dtype=torch.int32)
    for row, state in enumerate(states):
        state.fill(bitmask[row])
    return bitmask


def _bit(token_id: int) -> int:
    """Token t's bit in its int32 word (bit 31 is the sign bit)."""
    bit = 1 << (token_id % _BITS)
    return bit - (1 << _BITS) if bit >= 1 << (_BITS - 1) else bit


def _byte_masks() -> torch.Tensor:
    """[256, 8] float32: for each byte value, 0 at its set bits and -inf at its clear ones."""
    bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
    return torch.where(bits.bool(), 0.0, float("-inf"))


_BYTE_MASKS = _byte_masks()  # a constant, never written


def apply_bitmask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """Set to -inf, in place, every token of logits [R, V] that its row's mask (bitmask [n, W],
    one row per entry of `rows`) does not allow.

    The mask becomes an additive one, 0 for allowed tokens and -inf for the others, looked up a
    byte at a time (int32 words as little-endian bytes: token 8k + i is bit i of byte k) and
    added to the rows: adding 0 leaves a logit exactly as it was. A lookup and one add run ~10x
    faster here than unpacking the bits and a masked fill (~20 us against ~250 us a row)."""
    num_rows, vocab_size = len(rows), logits.shape[1]
    byte_masks = _BYTE_MASKS.to(device=logits.device, dtype=logits.dtype)
    byte_values = bitmask.view(torch.uint8).flatten().to(logits.device, torch.long)  # [n * W * 4]
    additive = byte_masks.index_select(0, byte_values).view(num_rows, -1)[:, :vocab_size]  # [n, V]
    logits.index_add_(0, torch.tensor(rows, dtype=torch.long, device=logits.device), additive)
