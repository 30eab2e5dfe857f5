"""Batched sampling: greedy, temperature, top-k, top-p, per-request seeds, logprobs.

A seeded request draws from a generator seeded by (seed, output index), so its tokens do not
depend on its batch neighbours, on preemption, or on how its prompt was chunked.
"""

from __future__ import annotations

import torch

from firsttoken.core.batch import SampleSpec
from firsttoken.outputs import SampledToken, TokenLogprob

_GOLDEN = 0x9E3779B97F4A7C15
_MASK63 = (1 << 63) - 1


def step_seed(seed: int, output_index: int) -> int:
    return (seed * _GOLDEN + output_index * 0xBF58476D1CE4E5B9 + 1) & _MASK63


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Logits [V] with every token outside the top-k and the top-p nucleus set to -inf.

    Both filters are floors on the value (the k-th largest logit; the logit of the token whose
    cumulative probability crosses top_p), so tokens with equal logits share one fate."""
    vocab_size = logits.shape[-1]
    if 0 < top_k < vocab_size:
        kth_largest = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if top_p < 1.0:
        sorted_logits = torch.sort(logits, descending=True).values
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # The smallest prefix whose mass reaches top_p, the crossing token included, ends at the
        # first token whose cumulative mass reaches top_p. With a tiny top_p (0 in float32) that
        # is the likeliest token, so one token always stays.
        crossing = min(int((cumulative < top_p).sum()), vocab_size - 1)
        logits = logits.masked_fill(logits < sorted_logits[crossing], float("-inf"))
    return logits


class Sampler:
    """Picks one token per row of logits; owns the generator of unseeded requests."""

    def __init__(self, seed: int, device: torch.device) -> None:
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def sample(self, logits: torch.Tensor, specs: list[SampleSpec]) -> list[SampledToken]:
        """logits: float32 [R, vocab], one row per spec."""
        token_ids = torch.argmax(logits, dim=-1)
        for row, spec in enumerate(specs):
            if not spec.sampling_params.greedy:
                token_ids[row] = self._sample_row(logits[row], spec)
        token_list = token_ids.tolist()
        needs_logprobs = [spec.sampling_params.logprobs is not None for spec in specs]
        if not any(needs_logprobs):
            return [SampledToken(token_id) for token_id in token_list]
        return self._with_logprobs(logits, token_ids, token_list, specs)

    def _sample_row(self, row_logits: torch.Tensor, spec: SampleSpec) -> torch.Tensor:
        """The drawn id as a 0-d tensor on the logits' device: no host round trip per row."""
        params = spec.sampling_params
        filtered = filter_logits(row_logits / params.temperature, params.top_k, params.top_p)
        probs = filtered.softmax(-1)
        generator = self.generator
        if params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(step_seed(params.seed, spec.output_index))
        return torch.multinomial(probs, 1, generator=generator)[0]

    @staticmethod
    def _with_logprobs(
        logits: torch.Tensor, token_ids: torch.Tensor, token_list: list[int], specs: list[SampleSpec]
    ) -> list[SampledToken]:
        logprobs = torch.log_softmax(logits, dim=-1)
        chosen = logprobs.gather(1, token_ids[:, None]).squeeze(1).tolist()
        max_top = max(spec.sampling_params.logprobs or 0 for spec in specs)
        top_values, top_ids = (
            torch.topk(logprobs, max_top, dim=-1) if max_top else (None, None)
        )
        results = []
        for row, spec in enumerate(specs):
            num_top = spec.sampling_params.logprobs
            if num_top is None:
                results.append(SampledToken(token_list[row]))
                continue
            top = [
                TokenLogprob(int(token_id), float(value))
                for token_id, value in zip(top_ids[row, :num_top].tolist(), top_values[row, :num_top].tolist())
            ] if num_top else []
            results.append(SampledToken(token_list[row], chosen[row], top))
        return results
