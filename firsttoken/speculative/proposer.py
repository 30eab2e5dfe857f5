"""What the engine asks of a proposer of draft tokens."""

from __future__ import annotations

from typing import Protocol


class DraftProposer(Protocol):
    """Proposes tokens likely to follow sequences; the target model verifies them."""

    def propose_batch(self, token_ids: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
        """For each sequence, up to its `max_tokens` tokens likely to follow it (none is fine)."""
        ...
