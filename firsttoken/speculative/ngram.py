"""Prompt lookup: propose the tokens that followed the latest earlier occurrence of the
sequence's last n tokens, n from `prompt_lookup_max` down to `prompt_lookup_min`.

Costs one vectorized pass over the sequence's tokens per step: no model, no state.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class NgramProposer:
    """Proposes by prompt lookup; it owns nothing but its three settings."""

    num_speculative_tokens: int
    prompt_lookup_max: int
    prompt_lookup_min: int

    def propose_batch(self, token_ids: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
        return [self.propose(sequence, limit) for sequence, limit in zip(token_ids, max_tokens)]

    def propose(self, token_ids: list[int], max_tokens: int) -> list[int]:
        """Up to min(num_speculative_tokens, max_tokens) tokens to follow `token_ids`, or none
        when no suffix of at least `prompt_lookup_min` tokens occurred before."""
        limit = min(self.num_speculative_tokens, max_tokens)
        if limit <= 0 or len(token_ids) <= self.prompt_lookup_min:
            return []
        tokens = np.asarray(token_ids)
        last = tokens.shape[0] - 1
        # Earlier positions holding the last token: where a matching n-gram could end.
        ends = np.flatnonzero(tokens[:last] == tokens[last])
        if ends.shape[0] == 0:
            return []
        match_lengths = np.ones(ends.shape[0], dtype=np.int64)
        matching = np.ones(ends.shape[0], dtype=bool)
        for back in range(1, self.prompt_lookup_max):
            positions = ends - back
            matching &= positions >= 0
            matching[matching] = tokens[positions[matching]] == tokens[last - back]
            match_lengths += matching
        longest = int(match_lengths.max())
        if longest < self.prompt_lookup_min:
            return []
        end = int(ends[np.flatnonzero(match_lengths == longest)[-1]])
        return tokens[end + 1 : end + 1 + limit].tolist()
