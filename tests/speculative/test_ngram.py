"""The prompt-lookup proposer against a plain per-position search."""

from __future__ import annotations

import random

import pytest

from firsttoken.speculative.ngram import NgramProposer


def reference_proposal(tokens: list[int], k: int, longest: int, shortest: int) -> list[int]:
    """For n from longest to shortest: the tokens after the latest earlier occurrence of the
    last n tokens (an occurrence may overlap the suffix, never be it)."""
    for n in range(longest, shortest - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


@pytest.mark.parametrize("seed", range(200))
def test_matches_a_plain_search(seed):
    rng = random.Random(seed)
    tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 60))]
    longest = rng.randrange(1, 6)
    shortest = rng.randrange(1, longest + 1)
    k = rng.randrange(1, 6)
    proposer = NgramProposer(num_speculative_tokens=k, prompt_lookup_max=longest, prompt_lookup_min=shortest)
    assert proposer.propose(tokens, max_tokens=k) == reference_proposal(tokens, k, longest, shortest)


def test_prefers_the_longest_match_then_the_latest():
    proposer = NgramProposer(num_speculative_tokens=2, prompt_lookup_max=3, prompt_lookup_min=1)
    #          a  b  c  X  Y  .  z  c  Q  .  a  b  c
    tokens = [1, 2, 3, 50, 51, 0, 9, 3, 60, 0, 1, 2, 3]
    assert proposer.propose(tokens, max_tokens=4) == [50, 51]  # "a b c" beats the later "c"
    assert proposer.propose([9, 3, 60, 0, 5, 3, 70, 0, 3], max_tokens=4) == [70, 0]


def test_proposes_nothing_without_a_long_enough_match_or_room():
    proposer = NgramProposer(num_speculative_tokens=4, prompt_lookup_max=4, prompt_lookup_min=2)
    assert proposer.propose([1, 2, 3, 4, 5, 6], max_tokens=4) == []
    assert proposer.propose([7, 1, 8, 2, 1], max_tokens=4) == []  # only a one-token match
    assert proposer.propose([1, 2, 9, 1, 2], max_tokens=0) == []
    assert proposer.propose([1, 2, 9, 1, 2], max_tokens=1) == [9]
