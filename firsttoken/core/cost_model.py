"""How long a step takes on this device: a fitted linear model, corrected online.

Measured once at start-up (worker/cost_calibration.py), the model predicts a step from its
token count and its attention work; every real step then nudges a multiplicative correction,
so the prediction follows the machine as it is now (other load, thermal state).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Protocol


class ChunkShape(Protocol):
    """What the cost of a step's chunk depends on."""

    @property
    def start_position(self) -> int: ...

    @property
    def num_tokens(self) -> int: ...


@dataclass(frozen=True)
class StepCostModel:
    """seconds = fixed + per_token * prefill tokens + per_attention_pair * their attention pairs
    + (per_token + per_decode_row) * decode rows + per_decode_pair * the decode rows' pairs,
    where a token at position p of its sequence contributes p attention pairs.

    Decode rows (one-token chunks) are priced apart. Each samples: an LM head row and a draw over
    the vocabulary, which a prefill token skips. And each reads its whole context from memory,
    where a prefill chunk reads a cached key once for all its rows from cache-resident tiles.
    On a 2-core Xeon with AMX a decode row cost 1.2 ms of a step beside a prefill token's 0.19,
    and a decode row's pair 9x a prefill's; a model with one price per token and per pair saw a
    step of 25 decodes as 38 ms where it took 55."""

    seconds_fixed: float
    seconds_per_token: float
    seconds_per_attention_pair: float
    # One decode alone, measured: the fit's fixed cost extrapolates it from prefills of hundreds
    # of tokens, and moved from 12 to 27 ms between two calibrations of one machine. 0: unknown.
    seconds_one_decode: float = 0.0
    # What a decode row costs beyond a prefill token; 0 where not measured.
    seconds_per_decode_row: float = 0.0
    # 0: not measured; decode rows' pairs are then priced as a prefill's.
    seconds_per_decode_pair: float = 0.0

    @property
    def decode_pair_seconds(self) -> float:
        return self.seconds_per_decode_pair or self.seconds_per_attention_pair

    def decode_step(self, num_decodes: int, num_attention_pairs: int) -> float:
        """A step of `num_decodes` decodes alone (at least one) over `num_attention_pairs` cached
        keys in all: never under the measured one."""
        return max(
            self.seconds_one_decode, self.predict(0, 0, max(1, num_decodes), max(1, num_attention_pairs))
        )

    def predict(
        self, num_tokens: int, num_attention_pairs: int, num_decodes: int = 0, num_decode_pairs: int = 0
    ) -> float:
        """A step of prefill chunks holding `num_tokens` tokens and `num_attention_pairs` pairs,
        beside `num_decodes` decode rows with `num_decode_pairs`."""
        return (
            self.seconds_fixed
            + self.seconds_per_token * (num_tokens + num_decodes)
            + self.seconds_per_attention_pair * num_attention_pairs
            + self.seconds_per_decode_row * num_decodes
            + self.decode_pair_seconds * num_decode_pairs
        )

    def prompt_seconds(self, num_tokens: int, context_tokens: int = 0) -> float:
        """A prompt chunk's own compute (its tokens and their attention pairs), the step's
        fixed cost aside."""
        return self.seconds_per_token * num_tokens + self.seconds_per_attention_pair * attention_pairs(
            context_tokens, num_tokens
        )

    def predict_chunks(self, chunks: Iterable[ChunkShape]) -> float:
        """A step of these chunks (each a start position and a token count)."""
        return self.predict(*step_work(chunks))

    def scaled(self, factor: float) -> StepCostModel:
        return replace(
            self,
            seconds_fixed=self.seconds_fixed * factor,
            seconds_per_token=self.seconds_per_token * factor,
            seconds_per_attention_pair=self.seconds_per_attention_pair * factor,
            seconds_one_decode=self.seconds_one_decode * factor,
            seconds_per_decode_row=self.seconds_per_decode_row * factor,
            seconds_per_decode_pair=self.seconds_per_decode_pair * factor,
        )

    def tokens_costing(self, seconds: float) -> int:
        """Tokens whose own compute (attention aside) takes `seconds`."""
        if self.seconds_per_token <= 0:
            return 0
        # Rounded first: 0.082 / 0.002 is 41.000000000000004 in floats, and 41 tokens it is.
        return math.ceil(round(seconds / self.seconds_per_token, 9))

    def max_prefill_tokens(
        self, seconds: float, num_decodes: int, decode_attention_pairs: int, prefill_context_tokens: int
    ) -> int:
        """Largest prefill chunk x that, with the decodes, fits a step into `seconds`.

        A chunk of x tokens after c cached tokens adds about x * (c + x / 2) attention pairs,
        so x is the positive root of a quadratic.
        """
        spare = seconds - self.predict(0, 0, num_decodes, decode_attention_pairs)
        if spare <= 0:
            return 0
        quadratic = self.seconds_per_attention_pair / 2
        linear = self.seconds_per_token + self.seconds_per_attention_pair * prefill_context_tokens
        if quadratic <= 0:
            return int(spare / linear) if linear > 0 else 1 << 30
        return int((-linear + (linear * linear + 4 * quadratic * spare) ** 0.5) / (2 * quadratic))


def step_work(chunks: Iterable[ChunkShape]) -> tuple[int, int, int, int]:
    """What a step's cost is fitted on: its prefill chunks' tokens and attention pairs, and its
    decode rows (one-token chunks) and theirs."""
    num_tokens = prefill_pairs = num_decodes = decode_pairs = 0
    for chunk in chunks:
        pairs = attention_pairs(chunk.start_position, chunk.num_tokens)
        if chunk.num_tokens == 1:
            num_decodes += 1
            decode_pairs += pairs
        else:
            num_tokens += chunk.num_tokens
            prefill_pairs += pairs
    return num_tokens, prefill_pairs, num_decodes, decode_pairs


def attention_pairs(start_position: int, num_tokens: int) -> int:
    """Attention pairs of a chunk of `num_tokens` tokens starting at `start_position`."""
    return num_tokens * start_position + num_tokens * (num_tokens + 1) // 2


class StepTimeTracker:
    """Owns the calibrated model and the online correction factor applied to it."""

    MIN_CORRECTION = 0.25
    MAX_CORRECTION = 4.0

    def __init__(self, calibrated: StepCostModel, smoothing: float = 0.2) -> None:
        self.calibrated = calibrated
        self.smoothing = smoothing
        self.correction = 1.0

    @property
    def model(self) -> StepCostModel:
        return self.calibrated.scaled(self.correction)

    def observe(self, chunks: Iterable[ChunkShape], seconds: float) -> None:
        """Nudge the correction toward a finished step's measured time over its prediction."""
        predicted = self.calibrated.predict_chunks(chunks)
        if predicted <= 0 or seconds <= 0:
            return
        ratio = min(self.MAX_CORRECTION, max(self.MIN_CORRECTION, seconds / predicted))
        self.correction += self.smoothing * (ratio - self.correction)
