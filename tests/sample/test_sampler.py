"""Sampling: top-p keeps the likeliest token however small top_p is; tiny temperatures are greedy;
the batched filter equals the per-row reference; a seeded row's token does not depend on its batch;
draws follow the filtered softmax; logprobs are a plain log_softmax."""

from __future__ import annotations

import pytest
import torch

from firsttoken.core.batch import SampleSpec
from firsttoken.outputs import TokenLogprob
from firsttoken.sample.sampler import (
    Nucleus,
    Sampler,
    candidate_width,
    filter_logits,
    find_nucleus,
    seeded_uniform,
)
from firsttoken.sampling_params import GREEDY_TEMPERATURE, MIN_REPETITION_PENALTY, SamplingParams
from tests.sample.distributions import NUM_DRAWS, SIGNIFICANCE, assert_follows, chi_square_p_value


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


def test_a_row_of_nan_logits_draws_a_kept_token_instead_of_failing():
    """A NaN logit (a broken model, an overflow) makes its row's running sums NaN, which every
    target lies past: the draw stays on the row's kept candidates and the other rows keep theirs."""
    logits = torch.randn(3, 500, generator=torch.Generator().manual_seed(3))
    logits[1, 7] = float("nan")
    sampler = Sampler(seed=0, device=torch.device("cpu"), vocab_size=logits.shape[-1])
    cases = [
        dict(temperature=1.0, top_k=64, seed=1),
        dict(temperature=1.0, top_k=1, seed=2),
        dict(temperature=0.0),
    ]
    specs = [SampleSpec(SamplingParams(**case), 0, f"r{index}") for index, case in enumerate(cases)]
    tokens = [sampled.token_id for sampled in sampler.sample(logits, specs)]
    assert all(0 <= token < logits.shape[-1] for token in tokens)
    assert tokens[2] == int(logits[2].argmax())


def test_the_smallest_repetition_penalty_at_the_lowest_temperature_keeps_logits_finite():
    """What MIN_REPETITION_PENALTY guards: a penalized logit of 1e4 divided by it and by a
    temperature just above greedy stays a float32."""
    largest = torch.tensor(1e4) / MIN_REPETITION_PENALTY / (GREEDY_TEMPERATURE * 1.01)
    assert torch.isfinite(largest.float())
    with pytest.raises(ValueError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=MIN_REPETITION_PENALTY / 2)


def test_near_zero_temperature_is_greedy_not_nan():
    logits = torch.randn(3, 500, generator=torch.Generator().manual_seed(2))
    sampler = Sampler(seed=0, device=torch.device("cpu"), vocab_size=logits.shape[-1])
    specs = [SampleSpec(SamplingParams(temperature=t), 0, f"r{t}") for t in (1e-40, 1e-6, 0.0)]
    tokens = [sampled.token_id for sampled in sampler.sample(logits, specs)]
    assert tokens == logits.argmax(-1).tolist()


# --- The batched sampler against plain per-row references -----------------------------------

CPU = torch.device("cpu")
MIXED_FILTERS = [  # (top_k, top_p): every candidate width, and widths shared by rows with and without top-p
    (-1, 1.0), (5, 1.0), (-1, 0.9), (40, 0.95), (2000, 0.5), (1, 0.3), (100, 0.3), (63, 0.99),
    (64, 0.8), (999, 0.9), (-1, 1e-9), (3, 1e-9), (5, 0.5), (40, 1.0), (1000, 1.0),
]


def _spec(output_index: int = 0, **params) -> SampleSpec:
    return SampleSpec(SamplingParams(**params), output_index, "request")


def _tokens(sampler: Sampler, logits: torch.Tensor, specs: list[SampleSpec]) -> list[int]:
    return [sampled.token_id for sampled in sampler.sample(logits, specs)]


def _nucleus_of_rows(
    logits: torch.Tensor, filters: list[tuple[int, float]], width: int | None, temperature: float = 1.0
) -> Nucleus:
    vocab_size = logits.shape[-1]
    top_k = torch.tensor([[k if 0 < k < vocab_size else vocab_size] for k, _ in filters])
    top_p = torch.tensor([[p] for _, p in filters])
    return find_nucleus(logits, torch.full((len(filters), 1), temperature), top_k, top_p, width)


def _kept_token_ids(nucleus: Nucleus, row: int) -> list[int]:
    num_kept = int(nucleus.num_kept[row])
    if nucleus.token_ids is None:
        return list(range(num_kept))
    return sorted(nucleus.token_ids[row, :num_kept].tolist())


def _filtered_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    return filter_logits(logits / temperature, top_k, top_p).softmax(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_batched_filter_equals_the_per_row_reference(seed, temperature):
    vocab_size = 1000
    logits = torch.randn(len(MIXED_FILTERS), vocab_size, generator=torch.Generator().manual_seed(seed)) * 3
    widths = [candidate_width(k, p, vocab_size) for k, p in MIXED_FILTERS]
    for width in set(widths):
        rows = [row for row, row_width in enumerate(widths) if row_width == width]
        nucleus = _nucleus_of_rows(logits[rows], [MIXED_FILTERS[row] for row in rows], width, temperature)
        assert nucleus.complete.all()
        for position, row in enumerate(rows):
            scaled = logits[row] / temperature
            reference = filter_logits(scaled, *MIXED_FILTERS[row])
            kept = _kept_token_ids(nucleus, position)
            assert kept == _finite_token_ids(reference), (MIXED_FILTERS[row], width)
            batched = torch.full_like(scaled, float("-inf"))
            batched[kept] = scaled[kept]
            assert torch.equal(batched, reference)


def test_rows_without_a_filter_keep_everything_beside_filtered_rows():
    vocab_size = 300
    logits = torch.randn(3, vocab_size, generator=torch.Generator().manual_seed(3))
    full_sort = _nucleus_of_rows(logits, [(-1, 1.0), (5, 0.5), (-1, 0.3)], vocab_size)
    assert int(full_sort.num_kept[0]) == vocab_size
    candidates = _nucleus_of_rows(logits, [(5, 1.0), (5, 0.2), (1, 1.0)], candidate_width(5, 1.0, vocab_size))
    assert _kept_token_ids(candidates, 0) == sorted(torch.topk(logits[0], 5).indices.tolist())


def _tied_logits(vocab_size: int, seed: int) -> torch.Tensor:
    """One token at 5 and 100 tokens tied at 3, far more than the candidates of a top_k of 2 hold."""
    logits = torch.randn(vocab_size, generator=torch.Generator().manual_seed(seed)) - 5
    logits[7] = 5.0
    logits[100:200] = 3.0
    return logits


def test_ties_with_the_kth_largest_past_the_candidates_fall_back_to_a_full_sort():
    logits = _tied_logits(300, seed=4)[None]
    width = candidate_width(2, 0.99, 300)
    assert width < 101
    assert not _nucleus_of_rows(logits, [(2, 0.99)], width).complete.any()
    full_sort = _nucleus_of_rows(logits, [(2, 0.99)], 300)
    assert _kept_token_ids(full_sort, 0) == _finite_token_ids(filter_logits(logits[0], 2, 0.99))
    assert len(_kept_token_ids(full_sort, 0)) == 101


def test_a_tie_overflow_row_draws_from_every_tied_token():
    logits = _tied_logits(300, seed=5)
    num_draws = 5000
    specs = [_spec(temperature=1.0, top_k=2, seed=seed) for seed in range(num_draws)]
    tokens = _tokens(Sampler(0, CPU, logits.shape[-1]), logits.expand(num_draws, -1), specs)
    assert len(set(tokens) & set(range(100, 200))) == 100
    assert_follows(tokens, _filtered_probs(logits, 1.0, 2, 1.0))


def _mixed_batch(vocab_size: int, seed: int) -> tuple[torch.Tensor, list[SampleSpec]]:
    """Rows of every kind: greedy, unseeded, seeded, each candidate width, logprobs, a tie overflow."""
    generator = torch.Generator().manual_seed(seed)
    specs = [
        _spec(temperature=0.0),
        _spec(temperature=0.8, top_p=0.95, top_k=40),
        _spec(3, temperature=0.7, top_p=0.9, seed=11),
        _spec(temperature=1.2, logprobs=3),
        _spec(9, temperature=0.9, top_k=200, seed=12, logprobs=0),
        _spec(temperature=0.0, logprobs=2),
        _spec(1, temperature=1.0, top_k=2, seed=13),
        _spec(2, temperature=0.6, top_k=5, top_p=0.5, seed=14),
    ]
    logits = torch.randn(len(specs), vocab_size, generator=generator) * 2
    logits[6] = _tied_logits(vocab_size, seed)
    return logits, specs


def test_a_seeded_row_draws_the_same_token_whatever_the_batch():
    vocab_size = 2000  # 40 rows of it are enough elements for element-wise ops to split across threads
    others, other_specs = _mixed_batch(vocab_size, seed=6)
    generator = torch.Generator().manual_seed(7)
    for index, (top_k, top_p) in enumerate(MIXED_FILTERS + [(2, 1.0)]):
        spec = _spec(index, temperature=0.9, top_k=top_k, top_p=top_p, seed=100 + index)
        # top_k 2 on tied logits: the row is drawn again over a full sort.
        row = _tied_logits(vocab_size, index) if top_k == 2 else torch.randn(vocab_size, generator=generator)
        sampler = Sampler(0, CPU, vocab_size)
        (alone,) = _tokens(sampler, row[None], [spec])
        for size in (2, 5, 40):
            for position in {0, size // 2, size - 1}:
                # Neighbours cycle through the mixed batch: each size is another composition.
                before = [i % len(other_specs) for i in range(position)]
                after = [i % len(other_specs) for i in range(position, size - 1)]
                logits = torch.cat([others[before], row[None], others[after]])
                specs = [other_specs[i] for i in before] + [spec] + [other_specs[i] for i in after]
                assert _tokens(sampler, logits, specs)[position] == alone, (top_k, top_p, size, position)


def test_greedy_rows_take_the_argmax():
    logits, specs = _mixed_batch(500, seed=8)
    logits[0, 10:13] = logits[0].max() + 1  # ties: the first index, as torch.argmax
    tokens = _tokens(Sampler(0, CPU, logits.shape[-1]), logits, specs)
    greedy_rows = [row for row, spec in enumerate(specs) if spec.sampling_params.greedy]
    assert [tokens[row] for row in greedy_rows] == logits.argmax(-1)[greedy_rows].tolist()
    assert tokens[0] == 10


def test_an_all_greedy_batch_is_the_argmax():
    logits = torch.randn(6, 400, generator=torch.Generator().manual_seed(9))
    specs = [_spec(temperature=0.0, logprobs=(row % 3) or None) for row in range(6)]
    assert _tokens(Sampler(0, CPU, logits.shape[-1]), logits, specs) == logits.argmax(-1).tolist()


def test_an_empty_step_samples_nothing():
    assert Sampler(0, CPU, 100).sample(torch.empty(0, 100), []) == []


def test_logprobs_equal_a_plain_log_softmax():
    logits, specs = _mixed_batch(500, seed=10)
    sampled = Sampler(0, CPU, logits.shape[-1]).sample(logits, specs)
    for row, (spec, token) in enumerate(zip(specs, sampled)):
        num_top = spec.sampling_params.logprobs
        if num_top is None:
            assert token.logprob is None and token.top_logprobs is None
            continue
        reference = torch.log_softmax(logits[row], dim=-1)
        assert token.logprob == reference[token.token_id].item()
        values, token_ids = torch.topk(reference, num_top)
        assert token.top_logprobs == [
            TokenLogprob(token_id, value) for token_id, value in zip(token_ids.tolist(), values.tolist())
        ]


def test_top_k_past_the_vocabulary_filters_nothing():
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(11))
    assert candidate_width(51, 1.0, 50) is None
    assert torch.equal(filter_logits(logits[0], 51, 1.0), logits[0])
    nucleus = _nucleus_of_rows(logits, [(51, 0.9), (10**6, 0.9)], 50)
    assert _kept_token_ids(nucleus, 0) == _finite_token_ids(filter_logits(logits[0], 51, 0.9))
    specs = [_spec(temperature=1.0, top_k=10**6, seed=seed) for seed in range(2000)]
    tokens = _tokens(Sampler(0, CPU, logits.shape[-1]), logits[0].expand(2000, -1), specs)
    assert_follows(tokens, logits[0].softmax(-1))


@pytest.mark.parametrize("top_k", [-1, 40])
@pytest.mark.parametrize("seed", [None, 5])
def test_a_tiny_top_p_draws_the_likeliest_token(top_k, seed):
    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(12))
    specs = [_spec(row, temperature=2.0, top_p=1e-12, top_k=top_k, seed=seed) for row in range(4)]
    assert _tokens(Sampler(0, CPU, logits.shape[-1]), logits, specs) == logits.argmax(-1).tolist()


def test_a_temperature_just_above_the_greedy_threshold_draws_the_argmax():
    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(13))
    temperature = GREEDY_TEMPERATURE * 1.01
    specs = [
        _spec(temperature=temperature, top_p=top_p, seed=seed)
        for top_p, seed in [(1.0, 1), (0.9, 2), (1.0, None), (0.5, None)]
    ]
    assert not any(spec.sampling_params.greedy for spec in specs)
    assert _tokens(Sampler(0, CPU, logits.shape[-1]), logits, specs) == logits.argmax(-1).tolist()


def test_seeded_uniforms_lie_in_the_half_open_unit_interval():
    uniforms = [seeded_uniform(seed, index) for seed in (-3, 0, 1, 2**62) for index in range(200)]
    assert all(0.0 < u <= 1.0 for u in uniforms)
    assert len(set(uniforms)) == len(uniforms)


# --- Distribution: draws follow the filtered softmax ------------------------------------------

DISTRIBUTION_CASES = {  # name: (vocab_size, top_k, top_p), one per way a row is filtered
    "unfiltered": (12, -1, 1.0),
    "top-k candidates": (100, 6, 1.0),
    "top-k and top-p candidates": (100, 8, 0.8),
    "top-p full sort": (100, -1, 0.8),
}


@pytest.mark.parametrize("seeded", [True, False], ids=["seeded", "unseeded"])
@pytest.mark.parametrize("case", DISTRIBUTION_CASES)
def test_draws_follow_the_filtered_softmax(case, seeded):
    vocab_size, top_k, top_p = DISTRIBUTION_CASES[case]
    temperature = 0.7
    logits = torch.randn(vocab_size, generator=torch.Generator().manual_seed(14)) * 1.5
    # Seeds and output indices both vary: consecutive output indices of one seed are fresh draws.
    filters = dict(temperature=temperature, top_k=top_k, top_p=top_p)
    specs = [_spec(draw % 100, seed=draw // 100 if seeded else None, **filters) for draw in range(NUM_DRAWS)]
    tokens = _tokens(Sampler(15, CPU, vocab_size), logits.expand(NUM_DRAWS, -1), specs)
    assert_follows(tokens, _filtered_probs(logits, temperature, top_k, top_p))
    # The test has the power to catch a scheme off by the temperature, or one that drops a filter.
    assert chi_square_p_value(tokens, _filtered_probs(logits, 1.0, top_k, top_p)) < SIGNIFICANCE
    if (top_k, top_p) != (-1, 1.0):
        assert chi_square_p_value(tokens, _filtered_probs(logits, temperature, -1, 1.0)) < SIGNIFICANCE


@pytest.mark.parametrize("neighbour", ["next output index", "next seed"])
def test_neighbouring_seeded_draws_are_independent(neighbour):
    logits = torch.tensor([0.0, 0.3, -0.2, 0.5])
    probs = logits.softmax(-1)
    first = [_spec(0, temperature=1.0, seed=seed) for seed in range(0, 2 * NUM_DRAWS, 2)]
    if neighbour == "next output index":
        second = [_spec(1, temperature=1.0, seed=seed) for seed in range(0, 2 * NUM_DRAWS, 2)]
    else:
        second = [_spec(0, temperature=1.0, seed=seed + 1) for seed in range(0, 2 * NUM_DRAWS, 2)]
    sampler, rows = Sampler(0, CPU, logits.shape[-1]), logits.expand(NUM_DRAWS, -1)
    pairs = [a * 4 + b for a, b in zip(_tokens(sampler, rows, first), _tokens(sampler, rows, second))]
    assert_follows(pairs, torch.outer(probs, probs).flatten())
