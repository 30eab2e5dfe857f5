"""How long a step takes on this device: a fitted linear model, corrected online.

Measured once at start-up (worker/cost_calibration.py), the model predicts a step from its
token count and its attention work; every real step then nudges a multiplicative correction,
so the prediction follows the machine as it is now (other load, thermal state).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class StepCostModel:
    """seconds = fixed + per_token * tokens + per_attention_pair * attention pairs, where a
    token at position p of its sequence contributes p attention pairs."""

    seconds_fixed: float
    seconds_per_token: float
    seconds_per_attention_pair: float
    # One decode alone, measured: the fit's fixed cost extrapolates it from prefills of hundreds
    # of tokens, and moved from 12 to 27 ms between two calibrations of one machine. 0: unknown.
    seconds_one_decode: float = 0.0

    def decode_step(self, num_decodes: int, num_attention_pairs: int) -> float:
        """A step of `num_decodes` decodes alone (at least one): never under the measured one."""
        return max(self.seconds_one_decode, self.predict(max(1, num_decodes), max(1, num_attention_pairs)))

    def predict(self, num_tokens: int, num_attention_pairs: int) -> float:
        return (
            self.seconds_fixed
            + self.seconds_per_token * num_tokens
            + self.seconds_per_attention_pair * num_attention_pairs
        )

    def scaled(self, factor: float) -> StepCostModel:
        return replace(
            self,
            seconds_fixed=self.seconds_fixed * factor,
            seconds_per_token=self.seconds_per_token * factor,
            seconds_per_attention_pair=self.seconds_per_attention_pair * factor,
            seconds_one_decode=self.seconds_one_decode * factor,
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
        spare = seconds - self.predict(num_decodes, decode_attention_pairs)
        if spare <= 0:
            return 0
        quadratic = self.seconds_per_attention_pair / 2
        linear = self.seconds_per_token + self.seconds_per_attention_pair * prefill_context_tokens
        if quadratic <= 0:
            return int(spare / linear) if linear > 0 else 1 << 30
        return int((-linear + (linear * linear + 4 * quadratic * spare) ** 0.5) / (2 * quadratic))


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

    def observe(self, num_tokens: int, num_attention_pairs: int, seconds: float) -> None:
        predicted = self.calibrated.predict(num_tokens, num_attention_pairs)
        if predicted <= 0 or seconds <= 0:
            return
        ratio = min(self.MAX_CORRECTION, max(self.MIN_CORRECTION, seconds / predicted))
        self.correction += self.smoothing * (ratio - self.correction)
