"""The adaptive prefill budget and the online step-cost correction, with a known cost model."""

from __future__ import annotations

import pytest

from firsttoken.core.cost_model import StepCostModel, StepTimeTracker, attention_pairs
from firsttoken.core.policy import LatencyTargets, StepLoad, adaptive_prefill_budget, step_time_target

# 5 ms per step + 0.2 ms per token + 1 ns per attention pair.
COST = StepCostModel(seconds_fixed=0.005, seconds_per_token=0.0002, seconds_per_attention_pair=1e-9)
TARGETS = LatencyTargets(itl_target_s=0.1, itl_slowdown=2.0, min_chunk=32, max_chunk=2048)


def test_alone_on_the_step_a_prefill_takes_the_largest_chunk():
    load = StepLoad(num_decodes=0, decode_attention_pairs=0, num_prefill_candidates=1, head_prefill_context_tokens=0)
    assert adaptive_prefill_budget(load, COST, TARGETS) == 2048


def test_waiting_prefills_bound_the_step_by_the_absolute_target():
    load = StepLoad(num_decodes=0, decode_attention_pairs=0, num_prefill_candidates=3, head_prefill_context_tokens=0)
    budget = adaptive_prefill_budget(load, COST, TARGETS)
    assert COST.predict(budget, attention_pairs(0, budget)) <= 0.1
    assert COST.predict(budget + 8, attention_pairs(0, budget + 8)) > 0.1


def test_decodes_bound_the_step_to_a_slowdown_of_their_own_step():
    load = StepLoad(num_decodes=8, decode_attention_pairs=8 * 500, num_prefill_candidates=1, head_prefill_context_tokens=0)
    decode_only = COST.predict(8, 8 * 500)
    assert step_time_target(load, COST, TARGETS) == pytest.approx(2 * decode_only)
    budget = adaptive_prefill_budget(load, COST, TARGETS)
    step = COST.predict(8 + budget, 8 * 500 + attention_pairs(0, budget))
    assert step <= 2 * decode_only + 1e-9
    assert budget > 0


def test_long_context_shrinks_the_chunk_and_min_chunk_guarantees_progress():
    near = StepLoad(num_decodes=4, decode_attention_pairs=4000, num_prefill_candidates=1, head_prefill_context_tokens=0)
    far = StepLoad(num_decodes=4, decode_attention_pairs=4000, num_prefill_candidates=1, head_prefill_context_tokens=100_000)
    loose = LatencyTargets(itl_target_s=0.1, itl_slowdown=10.0, min_chunk=1, max_chunk=2048)
    assert 1 < adaptive_prefill_budget(far, COST, loose) < adaptive_prefill_budget(near, COST, loose)
    slow = COST.scaled(1000.0)
    assert adaptive_prefill_budget(near, slow, TARGETS) == TARGETS.min_chunk


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
