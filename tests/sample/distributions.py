"""Goodness of fit: whether sampled token ids follow a given distribution."""

from __future__ import annotations

import torch

NUM_DRAWS = 20000
SIGNIFICANCE = 1e-6  # a correct sampler fails one run in a million


def chi_square_p_value(tokens: list[int], probs: torch.Tensor) -> float:
    """p-value of the draws under probs [V]; a token drawn where probs is 0 gives 0."""
    counts = torch.bincount(torch.tensor(tokens), minlength=probs.numel()).double()
    expected = probs.double() * len(tokens)
    if (counts[expected == 0] > 0).any():
        return 0.0
    support = expected > 0
    chi_square = ((counts[support] - expected[support]) ** 2 / expected[support]).sum()
    degrees = int(support.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(degrees / 2), chi_square / 2))


def assert_follows(tokens: list[int], probs: torch.Tensor) -> None:
    assert chi_square_p_value(tokens, probs) > SIGNIFICANCE
