"""Fake requests for core tests: no model, no torch."""

from __future__ import annotations

from firsttoken.request import Request, RequestTimestamps
from firsttoken.sampling_params import SamplingParams

EOS = 0


def make_request(
    req_id: str,
    num_prompt_tokens: int,
    max_tokens: int = 8,
    first_token: int = 100,
    priority: int = 0,
    arrival: float = 0.0,
    prompt: list[int] | None = None,
    sampling_params: SamplingParams | None = None,
) -> Request:
    prompt_token_ids = (
        prompt if prompt is not None else list(range(first_token, first_token + num_prompt_tokens))
    )
    return Request(
        req_id=req_id,
        prompt_token_ids=prompt_token_ids,
        sampling_params=sampling_params or SamplingParams(max_tokens=max_tokens, temperature=0),
        eos_token_ids=frozenset({EOS}),
        max_total_tokens=len(prompt_token_ids) + max_tokens,
        timestamps=RequestTimestamps(arrival=arrival, tokenized=arrival),
        priority=priority,
    )
