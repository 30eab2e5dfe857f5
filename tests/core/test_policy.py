"""The adaptive prefill budget and the online step-cost correction, with a known cost model."""

from __future__ import annotations

import pytest

from firsttoken.core.cost_model import StepCostModel, StepTimeTracker, attention_pairs
from firsttoken.core.policy import LatencyTargets, StepLoad, adaptive_prefill_budget

# 5 ms per step + 0.2 ms per token + 1 ns per attention pair.
COST = StepCostModel(seconds_fixed=0.005, seconds_per_token=0.0002, seconds_per_attention_pair=1e-9)
TARGETS = LatencyTargets(itl_target_s=0.1, min_chunk=32, max_chunk=2048)


def load_of(num_decodes=0, decode_attention_pairs=0, candidates=1, context=0, remaining=100_000) -> StepLoad:
    return StepLoad(num_decodes, decode_attention_pairs, candidates, context, remaining)


def test_alone_on_the_step_a_prefill_takes_the_largest_chunk():
    assert adaptive_prefill_budget(load_of(), COST, TARGETS) == 2048


def test_waiting_prefills_bound_the_step_by_the_target():
    budget = adaptive_prefill_budget(load_of(candidates=3), COST, TARGETS)
    assert COST.predict(budget, attention_pairs(0, budget)) <= 0.1
    assert COST.predict(budget + 8, attention_pairs(0, budget + 8)) > 0.1


def test_decodes_share_the_target_with_the_chunk():
    alone = adaptive_prefill_budget(load_of(num_decodes=1, decode_attention_pairs=500), COST, TARGETS)
    busy = adaptive_prefill_budget(load_of(num_decodes=64, decode_attention_pairs=64 * 500), COST, TARGETS)
    assert busy < alone
    for decodes, budget in ((1, alone), (64, busy)):
        step = COST.predict(decodes + budget, decodes * 500 + attention_pairs(0, budget))
        assert 0.1 - 0.001 < step <= 0.1


def test_a_prompt_that_fits_the_target_is_not_cut_whatever_the_decodes_own_step():
    """A step of 4 decodes costs ~6 ms here; a 300-token chunk ~65 ms. Cutting the prompt to a
    few times the decode step would only delay its first token."""
    load = load_of(num_decodes=4, decode_attention_pairs=4000, remaining=300)
    assert adaptive_prefill_budget(load, COST, TARGETS) >= 300


def test_a_short_tail_is_taken_with_the_chunk_before_it():
    budget = adaptive_prefill_budget(load_of(num_decodes=4, decode_attention_pairs=4000), COST, TARGETS)
    with_tail = load_of(num_decodes=4, decode_attention_pairs=4000, remaining=budget + TARGETS.min_chunk - 1)
    assert adaptive_prefill_budget(with_tail, COST, TARGETS) == budget + TARGETS.min_chunk - 1
    longer = load_of(num_decodes=4, decode_attention_pairs=4000, remaining=budget + TARGETS.min_chunk)
    assert adaptive_prefill_budget(longer, COST, TARGETS) == budget


def test_long_context_shrinks_the_chunk_and_min_chunk_guarantees_progress():
    near = load_of(num_decodes=4, decode_attention_pairs=4000)
    far = load_of(num_decodes=4, decode_attention_pairs=4000, context=100_000)
    loose = LatencyTargets(itl_target_s=0.1, min_chunk=1, max_chunk=2048)
    assert 1 < adaptive_prefill_budget(far, COST, loose) < adaptive_prefill_budget(near, COST, loose)
    slow = COST.scaled(1000.0)
    assert adaptive_prefill_budget(near, slow, TARGETS) == TARGETS.min_chunk


def test_no_chunk_is_smaller_than_the_step_s_weight_read():
    """A CPU that reads its weights slowly against its compute: 80 ms a step, 2 ms a token. A
    25 ms target would cut chunks of the minimum 32 tokens, each step spending 80 ms of its 144
    re-reading the weights; the floor is the 40 tokens whose compute costs one weight read."""
    weight_bound = StepCostModel(seconds_fixed=0.08, seconds_per_token=0.002, seconds_per_attention_pair=0.0)
    assert weight_bound.weight_read_tokens() == 40
    tight = LatencyTargets(itl_target_s=0.025, min_chunk=32, max_chunk=2048)
    load = load_of(num_decodes=2, decode_attention_pairs=1000)
    assert adaptive_prefill_budget(load, weight_bound, tight) == 40
    assert adaptive_prefill_budget(load_of(num_decodes=2, remaining=79), weight_bound, tight) == 79
    assert adaptive_prefill_budget(load_of(num_decodes=2, remaining=80), weight_bound, tight) == 40
    tighter = LatencyTargets(itl_target_s=0.006, min_chunk=32, max_chunk=2048)
    assert adaptive_prefill_budget(load, COST, tighter) == 32  # 25 weight-read tokens: the minimum rules


def test_online_correction_follows_the_observed_speed():
    tracker = StepTimeTracker(COST, smoothing=0.5)
    for _ in range(20):
        tracker.observe(100, attention_pairs(0, 100), 2 * COST.predict(100, attention_pairs(0, 100)))
    assert tracker.correction == pytest.approx(2.0, rel=1e-3)
    assert tracker.model.predict(10, 0) == pytest.approx(2 * COST.predict(10, 0))
    for _ in range(50):
        tracker.observe(100, 0, 1000.0)
    assert tracker.correction == pytest.approx(StepTimeTracker.MAX_CORRECTION, rel=1e-3)


def test_attention_pairs_counts_every_query_key_pair():
    assert attention_pairs(0, 3) == 1 + 2 + 3
    assert attention_pairs(10, 2) == 11 + 12


def test_a_plan_covers_the_prompt_in_steps_under_the_target():
    from firsttoken.core.policy import plan_prefill

    alone = plan_prefill(3000, 0, 500, COST, TARGETS)
    assert alone.chunk_tokens == [2048, 952]  # nobody waits: the largest chunks
    busy = plan_prefill(3000, 16, 500, COST, TARGETS)
    assert sum(busy.chunk_tokens) == 3000 and len(busy.chunk_tokens) > 2
    # Every step but a short tail's stays under the target.
    assert all(seconds <= TARGETS.itl_target_s + 1e-9 for seconds in busy.step_seconds[:-1])
    assert busy.prefill_seconds == pytest.approx(sum(busy.step_seconds))
