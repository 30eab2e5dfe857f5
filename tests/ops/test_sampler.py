"""Sampling: top-p keeps the likeliest token however small top_p is; tiny temperatures are greedy."""

from __future__ import annotations

import pytest
import torch

from firsttoken.sample.sampler import filter_logits


@pytest.mark.parametrize("top_p", [5e-324, 1e-45, 1e-12])
def test_tiny_top_p_keeps_only_the_likeliest_token(top_p):
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    filtered = filter_logits(logits, top_k=-1, top_p=top_p)
    kept = torch.isfinite(filtered).nonzero().flatten().tolist()
    assert kept == [int(logits.argmax())]
    assert not torch.isnan(filtered.softmax(-1)).any()


def test_top_p_one_keeps_everything():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(1))
    assert torch.equal(filter_logits(logits, top_k=-1, top_p=1.0), logits)


def _finite_token_ids(filtered: torch.Tensor) -> list[int]:
    return torch.isfinite(filtered).nonzero().flatten().tolist()


def test_tokens_tied_with_the_crossing_token_are_all_kept():
    logits = torch.tensor([2.0, 1.0, 1.0, 1.0, 0.0])
    probs = logits.softmax(-1)
    top_p = float(probs[0] + probs[1] / 2)  # crosses at the first of the three tied tokens
    assert _finite_token_ids(filter_logits(logits, top_k=-1, top_p=top_p)) == [0, 1, 2, 3]
    assert _finite_token_ids(filter_logits(logits, top_k=2, top_p=1.0)) == [0, 1, 2, 3]


def test_near_zero_temperature_is_greedy_not_nan():
    from firsttoken.core.batch import SampleSpec
    from firsttoken.sample.sampler import Sampler
    from firsttoken.sampling_params import SamplingParams

    logits = torch.randn(3, 500, generator=torch.Generator().manual_seed(2))
    sampler = Sampler(seed=0, device=torch.device("cpu"))
    specs = [SampleSpec(SamplingParams(temperature=t), 0) for t in (1e-40, 1e-6, 0.0)]
    tokens = [sampled.token_id for sampled in sampler.sample(logits, specs)]
    assert tokens == logits.argmax(-1).tolist()
