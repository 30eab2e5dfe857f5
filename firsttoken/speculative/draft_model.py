"""The draft-model proposer: a second, smaller model sharing the target's tokenizer, run by
an engine of its own (its own worker, scheduler and paged KV cache), proposes tokens greedily.

Each step it is asked to continue every speculating sequence by up to k tokens: it runs them as
one batch of greedy requests. Its prompt cache keeps each sequence's full blocks from the
previous step, so a proposal costs the prefill of the few tokens added since (the target's
accepted tokens) and k - 1 batched decode steps. Greedy proposals are a point mass: accepting
while the target's own draw equals the proposal is exact speculative sampling for them.
"""

from __future__ import annotations

from typing import Protocol

from firsttoken.errors import InvalidInputError
from firsttoken.outputs import RequestDelta
from firsttoken.sampling_params import SamplingParams


class DraftEngine(Protocol):
    """The step loop of the draft model, as the proposer drives it (an EngineCore)."""

    def new_req_id(self) -> str: ...

    def add_request(
        self, req_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams
    ) -> object: ...

    def has_unfinished_requests(self) -> bool: ...

    def step(self) -> list[RequestDelta]: ...


class DraftModelProposer:
    """Owns the draft model's engine, which it steps to propose greedy continuations."""

    def __init__(self, core: DraftEngine, num_speculative_tokens: int) -> None:
        self.core = core
        self.num_speculative_tokens = num_speculative_tokens

    def propose_batch(self, token_ids: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
        proposals: dict[str, list[int]] = {}
        order = []
        for sequence, limit in zip(token_ids, max_tokens):
            req_id = self.core.new_req_id()
            order.append(req_id)
            proposals[req_id] = []
            greedy = SamplingParams(
                temperature=0, max_tokens=min(limit, self.num_speculative_tokens), ignore_eos=True
            )
            try:
                self.core.add_request(req_id, sequence, greedy)
            except InvalidInputError:
                continue  # longer than the draft's cache or context holds: this one goes without
        while self.core.has_unfinished_requests():
            for delta in self.core.step():
                proposals[delta.req_id].extend(delta.token_ids)
        return [proposals[req_id] for req_id in order]
