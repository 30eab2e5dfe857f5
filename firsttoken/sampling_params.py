"""SamplingParams: how one request picks its tokens and when it stops."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Mapping

from firsttoken.errors import InvalidInputError

GREEDY_TEMPERATURE = 1e-5
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-2, 2], as OpenAI's
# A repetition penalty divides positive logits: below this (5e-324 reads as 0 in float32) the
# quotient, then divided by a temperature down to GREEDY_TEMPERATURE, overflows to infinity.
MIN_REPETITION_PENALTY = 1e-6
MAX_LOGIT_BIAS = 100.0


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint the output must meet, enforced token by token by the grammar engine
    (sample/grammar.py): exactly one of a JSON schema, any JSON object, a regular expression, a
    choice of strings, or a grammar (Lark, or GBNF as llama.cpp writes it). `field` is the
    request field it came from, which errors about it name."""

    json_schema: str | None = None  # the schema as JSON text
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    field: str = "structured_output"

    def __post_init__(self) -> None:
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [self.json_schema is not None, self.json_object, self.regex is not None,
                 self.choice is not None, self.grammar is not None]
        if sum(given) != 1:
            raise InvalidInputError(
                self.field, "give exactly one of json_schema, json_object, regex, choice, grammar"
            )
        if self.choice is not None and (
            not self.choice or any(not isinstance(option, str) or not option for option in self.choice)
        ):
            raise InvalidInputError(self.field, "choice must be a non-empty list of non-empty strings")
        for name in ("json_schema", "regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise InvalidInputError(self.field, f"{name} must be a non-empty string")

    @property
    def key(self) -> tuple[object, ...]:
        """What identifies its compiled grammar."""
        return (self.json_schema, self.json_object, self.regex, self.choice, self.grammar)


@dataclass(frozen=True)
class SamplingParams:
    """Sampling and stopping rules of one request; temperature 0 means greedy.

    The logits processors (structured output, penalties, min_p, logit_bias, min_tokens,
    bad_words) change a row's logits before it is sampled; each is off at its default.
    Validated on construction: a bad value raises InvalidInputError naming the field and its limit.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    # Drop tokens whose probability is below min_p times the likeliest token's (0: off).
    min_p: float = 0.0
    seed: int | None = None
    # OpenAI's: subtract presence_penalty once from every token generated so far, and
    # frequency_penalty once per time it was generated.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # transformers' and vLLM's: a token in the prompt or generated so far has its logit divided
    # by repetition_penalty when positive, multiplied when negative (1: off).
    repetition_penalty: float = 1.0
    # Added to the logits of those token ids, in [-100, 100]: -100 bans a token, 100 forces it.
    logit_bias: Mapping[int, float] | None = None
    # End-of-sequence and stop_token_ids cannot be drawn before this many tokens are generated.
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    # Words never generated: the last token of a word's tokens is banned where the tokens
    # generated so far end with the ones before it (vLLM's rule).
    bad_words: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    # Score the prompt: each prompt token's log-probability given the ones before it (the first
    # has none), with this many likeliest alternatives (vLLM's prompt_logprobs). Such a request
    # does not read the prefix cache, so that every position is computed.
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # The output follows this grammar; it ends where the grammar does (end-of-sequence).
    structured_output: StructuredOutput | None = None
    # Set from the fields above: the sampler skips its logits processors for rows without any.
    processes_logits: bool = field(init=False, repr=False, compare=False)
    tracks_tokens: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        if isinstance(self.bad_words, str):
            object.__setattr__(self, "bad_words", (self.bad_words,))
        else:
            object.__setattr__(self, "bad_words", tuple(self.bad_words))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.logit_bias is not None:
            object.__setattr__(self, "logit_bias", _checked_logit_bias(self.logit_bias))
        self._validate()
        # A grammar's state follows the request's tokens, as the penalties' counts do.
        tracks_tokens = (
            self.has_penalties
            or bool(self.bad_words)
            or self.min_tokens > 0
            or self.structured_output is not None
        )
        object.__setattr__(self, "tracks_tokens", tracks_tokens)
        # min_p is a filter of the draw (sampler.py), not a change to the logits.
        object.__setattr__(self, "processes_logits", tracks_tokens or bool(self.logit_bias))

    def _validate(self) -> None:
        _check_int("max_tokens", self.max_tokens)
        if self.max_tokens < 1:
            raise InvalidInputError("max_tokens", f"must be >= 1, got {self.max_tokens}")
        if not self.temperature >= 0:  # also rejects NaN
            raise InvalidInputError("temperature", f"must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidInputError("top_p", f"must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1 or self.top_k == 0:
            raise InvalidInputError("top_k", f"must be -1 (off) or >= 1, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise InvalidInputError("min_p", f"must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise InvalidInputError(name, f"must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value}")
        if not (self.repetition_penalty >= MIN_REPETITION_PENALTY and math.isfinite(self.repetition_penalty)):
            raise InvalidInputError(
                "repetition_penalty",
                f"must be >= {MIN_REPETITION_PENALTY:g} and finite, got {self.repetition_penalty}",
            )
        _check_int("min_tokens", self.min_tokens)
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidInputError(
                "min_tokens", f"must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        if self.structured_output is not None and self.min_tokens > 0:
            # The grammar decides where the output ends: holding the end back could leave nothing to draw.
            raise InvalidInputError("min_tokens", "must be 0 with structured output")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            is_int = isinstance(value, int) and not isinstance(value, bool)
            if value is not None and not (is_int and 0 <= value <= 20):
                raise InvalidInputError(name, f"must be an integer in [0, 20], got {value!r}")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise InvalidInputError("stop", "every stop string must be a non-empty string")
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.stop_token_ids):
            raise InvalidInputError("stop_token_ids", "every id must be an integer >= 0")
        if any(not isinstance(word, str) or not word.strip() for word in self.bad_words):
            raise InvalidInputError("bad_words", "every bad word must be a string with a non-space character")

    @property
    def greedy(self) -> bool:
        """Temperatures this close to 0 are greedy: dividing logits by them overflows."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


def _check_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidInputError(name, f"must be an integer, got {value!r}")


def _checked_logit_bias(logit_bias: Mapping[int, float]) -> dict[int, float]:
    """A copy, so that the caller's dict changing later cannot change a queued request."""
    checked = {}
    for token_id, bias in dict(logit_bias).items():
        if not isinstance(token_id, int) or isinstance(token_id, bool) or token_id < 0:
            raise InvalidInputError("logit_bias", f"keys must be token ids (integers >= 0), got {token_id!r}")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)):
            raise InvalidInputError(f"logit_bias[{token_id}]", f"must be a number, got {bias!r}")
        if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise InvalidInputError(
                f"logit_bias[{token_id}]", f"must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bias}"
            )
        checked[token_id] = float(bias)
    return checked


def choice_seed(seed: int, choice_index: int) -> int:
    """The seed choice `choice_index` of a request seeded `seed` draws with: `seed` itself for the
    first (n=1 draws as before), a hash of both for the others, so that no choice draws as some
    choice of another seed does (seed + index made choice 1 of seed 42 choice 0 of seed 43)."""
    if choice_index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}/{choice_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # 63 bits, as the sampler's seeds are
