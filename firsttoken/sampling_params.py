"""SamplingParams: how one request picks its tokens and when it stops."""

from __future__ import annotations

from dataclasses import dataclass

from firsttoken.errors import InvalidInputError

GREEDY_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """Sampling and stopping rules of one request; temperature 0 means greedy.

    Validated on construction: a bad value raises InvalidInputError naming the field and its limit.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        self._validate()

    def _validate(self) -> None:
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool):
            raise InvalidInputError("max_tokens", f"must be an integer, got {self.max_tokens!r}")
        if self.max_tokens < 1:
            raise InvalidInputError("max_tokens", f"must be >= 1, got {self.max_tokens}")
        if not self.temperature >= 0:  # also rejects NaN
            raise InvalidInputError("temperature", f"must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidInputError("top_p", f"must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1 or self.top_k == 0:
            raise InvalidInputError("top_k", f"must be -1 (off) or >= 1, got {self.top_k}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise InvalidInputError("logprobs", f"must be in [0, 20], got {self.logprobs}")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise InvalidInputError("stop", "every stop string must be a non-empty string")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise InvalidInputError("stop_token_ids", "every id must be an integer >= 0")

    @property
    def greedy(self) -> bool:
        """Temperatures this close to 0 are greedy: dividing logits by them overflows."""
        return self.temperature < GREEDY_TEMPERATURE
