"""Integer arithmetic shared by every layer of the package."""

from __future__ import annotations

from typing import TypeVar

Number = TypeVar("Number", int, float)


def ceil_div(numerator: Number, denominator: Number) -> Number:
    """numerator / denominator rounded up, for a positive denominator (blocks for tokens,
    panels for rows, words for bits); a float's quotient is rounded up to a whole float."""
    return -(-numerator // denominator)
