"""Sampled tokens with their log-probabilities: what the sampler returns, what a request keeps
of its scored prompt, and what outputs carry."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TokenLogprob:
    """One alternative token and its log-probability."""

    token_id: int
    logprob: float


@dataclass(frozen=True)
class SampledToken:
    """A sampled token, with its log-probability and the top alternatives when asked for."""

    token_id: int
    logprob: float | None = None
    top_logprobs: list[TokenLogprob] | None = None
    # 1 + how many tokens were likelier; known for scored prompt tokens (vLLM reports it).
    rank: int | None = None
    # Set when the request's grammar had failed before this draw: the token is then only the
    # end-of-sequence the mask left, and the request ends with this error.
    grammar_error: str | None = None
