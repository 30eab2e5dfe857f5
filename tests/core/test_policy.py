"""The adaptive prefill budget and the online step-cost correction, with a known cost model."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

from firsttoken.core.cost_model import StepCostModel, StepTimeTracker, attention_pairs, step_work
from firsttoken.core.arrival_rate import ArrivalRate
from firsttoken.core.policy import (
    LatencyTargets,
    StepLoad,
    adaptive_prefill_budget,
    decode_step_seconds,
    MAX_BUSY_PERIOD_FACTOR,
    StepSharing,
    busy_period_factor,
    joins_step,
    overtaking_size,
    step_limit_seconds,
)

# 5 ms per step + 0.2 ms per token + 1 ns per attention pair: a decode step alone is ~5.2 ms.
COST = StepCostModel(seconds_fixed=0.005, seconds_per_token=0.0002, seconds_per_attention_pair=1e-9)
TARGETS = LatencyTargets(max_stall_factor=20, max_step_s=None, min_chunk=32, max_chunk=2048)


def load_of(
    num_decodes=0, decode_attention_pairs=0, context=0, remaining=100_000, delayed=1.0, overtaking=0.0
):
    return StepLoad(num_decodes, decode_attention_pairs, context, remaining, delayed, overtaking)


def step_seconds(load: StepLoad, budget: int) -> float:
    return COST.predict(
        load.num_decodes + budget,
        load.decode_attention_pairs + attention_pairs(load.head_prefill_context_tokens, budget),
    )


def test_a_step_with_a_chunk_takes_at_most_the_factor_times_the_decodes_own_step():
    for num_decodes in (0, 1, 16, 64):
        load = load_of(num_decodes=num_decodes, decode_attention_pairs=500 * num_decodes)
        budget = adaptive_prefill_budget(load, COST, TARGETS)
        limit = 20 * decode_step_seconds(load, COST)
        assert step_seconds(load, budget) <= limit < step_seconds(load, budget + 8)


def test_busier_decodes_allow_a_longer_step_in_time():
    """The bound is relative to the decodes' own step: more streams make each step longer, so
    a cut costs the prompt more and the step may hold more."""
    idle = load_of(num_decodes=1, decode_attention_pairs=500)
    busy = load_of(num_decodes=64, decode_attention_pairs=64 * 500)
    assert step_limit_seconds(busy, COST, TARGETS) > step_limit_seconds(idle, COST, TARGETS)


def test_a_prompt_that_fits_the_bound_is_taken_whole():
    load = load_of(num_decodes=4, decode_attention_pairs=4000, remaining=300)
    assert adaptive_prefill_budget(load, COST, TARGETS) >= 300


def test_an_absolute_step_bound_applies_as_well():
    tight = LatencyTargets(max_stall_factor=20, max_step_s=0.05, min_chunk=32, max_chunk=2048)
    load = load_of(num_decodes=4, decode_attention_pairs=4000)
    budget = adaptive_prefill_budget(load, COST, tight)
    assert step_seconds(load, budget) <= 0.05 < step_seconds(load, budget + 8)


def test_a_queue_behind_the_head_lengthens_the_step_by_its_square_root():
    """Each cut delays every prompt in line by a decode step."""
    alone = step_limit_seconds(load_of(num_decodes=4, decode_attention_pairs=4000), COST, TARGETS)
    queued = step_limit_seconds(
        load_of(num_decodes=4, decode_attention_pairs=4000, delayed=9.0), COST, TARGETS
    )
    assert queued == pytest.approx(3 * alone)


def test_shorter_prompts_arriving_shorten_the_step_to_the_balance_of_waits():
    """Prompts that would overtake the head wait only for the step in flight: at a rate r, a
    prefill cut into steps of T costs the n delayed prompts a decode step d per cut and the
    arrivals T / 2 each, least at T = sqrt(2 d n / r)."""
    load = load_of(num_decodes=4, decode_attention_pairs=4000, delayed=2.0, overtaking=5.0)
    decode_step_s = decode_step_seconds(load, COST)
    expected = math.sqrt(2 * decode_step_s * 2.0 / 5.0)
    assert step_limit_seconds(load, COST, TARGETS) == pytest.approx(expected)
    rare = load_of(num_decodes=4, decode_attention_pairs=4000, delayed=2.0, overtaking=1e-6)
    assert step_limit_seconds(rare, COST, TARGETS) == pytest.approx(20 * decode_step_s * math.sqrt(2.0))


def test_a_short_tail_is_taken_with_the_chunk_before_it():
    budget = adaptive_prefill_budget(load_of(num_decodes=4, decode_attention_pairs=4000), COST, TARGETS)
    floor = max(TARGETS.min_chunk, COST.tokens_costing(decode_step_seconds(load_of(4, 4000), COST)))
    with_tail = load_of(num_decodes=4, decode_attention_pairs=4000, remaining=budget + floor - 1)
    assert adaptive_prefill_budget(with_tail, COST, TARGETS) == budget + floor - 1
    longer = load_of(num_decodes=4, decode_attention_pairs=4000, remaining=budget + floor)
    assert adaptive_prefill_budget(longer, COST, TARGETS) == budget


def test_long_context_shrinks_the_chunk_down_to_a_decode_step_s_work():
    near = load_of(num_decodes=4, decode_attention_pairs=4000)
    far = load_of(num_decodes=4, decode_attention_pairs=4000, context=100_000)
    loose = LatencyTargets(max_stall_factor=20, max_step_s=None, min_chunk=1, max_chunk=2048)
    assert 1 < adaptive_prefill_budget(far, COST, loose) < adaptive_prefill_budget(near, COST, loose)
    attention_bound = StepCostModel(
        seconds_fixed=0.005, seconds_per_token=0.0002, seconds_per_attention_pair=1e-6
    )
    floor = attention_bound.tokens_costing(decode_step_seconds(far, attention_bound))
    assert floor > TARGETS.min_chunk
    assert adaptive_prefill_budget(far, attention_bound, TARGETS) == floor


def test_no_chunk_does_less_work_than_a_decode_step():
    """A CPU that reads its weights slowly against its compute: 80 ms a step, 2 ms a token. An
    absolute bound of 25 ms would cut chunks of 32 tokens, each step spending 80 ms of its 144
    on what every step pays; the floor is the 41 tokens whose compute costs one decode step."""
    weight_bound = StepCostModel(seconds_fixed=0.08, seconds_per_token=0.002, seconds_per_attention_pair=0.0)
    tight = LatencyTargets(max_stall_factor=20, max_step_s=0.025, min_chunk=32, max_chunk=2048)
    load = load_of(num_decodes=1, decode_attention_pairs=1000)
    assert weight_bound.tokens_costing(decode_step_seconds(load, weight_bound)) == 41
    assert adaptive_prefill_budget(load, weight_bound, tight) == 41
    assert adaptive_prefill_budget(load_of(num_decodes=1, remaining=81), weight_bound, tight) == 81
    assert adaptive_prefill_budget(load_of(num_decodes=1, remaining=82), weight_bound, tight) == 41


def test_a_short_prompt_joins_a_step_and_a_long_one_takes_its_own():
    decode_step_s = 0.01
    # 20 tokens (4 ms) beside one prompt, sparing itself a 10 ms step: joins.
    assert joins_step(1, 0, 20, 1, decode_step_s, COST)
    # 500 tokens (100 ms) would delay the step's prompt more than the step it spares.
    assert not joins_step(1, 0, 500, 1, decode_step_s, COST)
    # ...unless enough prompts behind it are spared that step too.
    assert joins_step(1, 0, 500, 11, decode_step_s, COST)
    # Each prompt already in the step is delayed.
    assert not joins_step(11, 0, 500, 11, decode_step_s, COST)


def test_a_busy_engine_shares_steps_it_would_not_share_idle():
    """A step added while arrivals keep the engine busy delays every prompt until it catches up:
    at a utilization of 0.8 that lasts five times the line's own wait, so a second 500-token
    prompt joins the step where, with the engine idle behind the line, it takes its own."""
    assert busy_period_factor(0.0) == 1.0
    assert busy_period_factor(0.8) == pytest.approx(5.0)
    assert busy_period_factor(1.5) == MAX_BUSY_PERIOD_FACTOR  # past saturation: held
    idle = StepSharing(decode_step_s=0.03, num_arriving=0.5, cost_model=COST)
    busy = StepSharing(0.03, num_arriving=0.5, cost_model=COST, busy_factor=busy_period_factor(0.8))
    assert not idle.joins(1, 0, 500, 1)
    assert busy.joins(1, 0, 500, 1)
    # A started prompt's share of the step is not stretched: it would hold short ones behind it.
    assert busy.max_started_tokens(1, 0, 1) == idle.max_started_tokens(1, 0, 1)


def test_only_a_much_shorter_prompt_counts_as_overtaking():
    """A prompt two tokens shorter than the head's remainder would go first, but saves nothing
    worth a cut: its own prefill delays the head by about what it gains."""
    rate = ArrivalRate()
    for index, size in enumerate((510, 514, 511, 509)):
        rate.record(float(index), size, found_idle=False)
    assert rate.share_shorter_than(4.0, overtaking_size(512)) == 0.0
    rate.record(4.0, 64, found_idle=False)
    assert rate.share_shorter_than(4.0, overtaking_size(512)) == pytest.approx(1 / 5)


def test_arrival_rate_counts_recent_arrivals_and_their_sizes():
    rate = ArrivalRate(window=8, horizon_s=10.0)
    assert rate.per_second(0.0) == 0.0
    for index in range(5):
        rate.record(index * 0.5, 100 if index % 2 else 1000, found_idle=False)
    assert rate.per_second(2.0) == pytest.approx(4 / 2.0)
    assert rate.share_shorter_than(2.0, 500) == pytest.approx(2 / 5)
    assert rate.per_second(100.0) == 0.0  # all past the horizon


def test_arrivals_that_found_work_in_flight_give_their_rate():
    rate = ArrivalRate()
    for second in range(5):
        rate.record(float(second), 128, found_idle=second == 0)
    assert rate.per_second(4.0) == pytest.approx(1.0)


def test_arrivals_that_all_found_the_engine_idle_come_at_no_rate_while_it_works():
    rate = ArrivalRate()
    for second in range(5):
        rate.record(float(second), 128, found_idle=True)
    assert rate.per_second(4.0) == 0.0
    # One that finds a prompt in flight: the rate is the arrivals' again.
    rate.record(5.0, 128, found_idle=False)
    assert rate.per_second(5.0) == pytest.approx(1.0)
    # Until the window holds only idle finds again.
    window = ArrivalRate(window=3)
    for second, idle in enumerate([False, True, True, True]):
        window.record(float(second), 128, found_idle=idle)
    assert window.per_second(3.0) == 0.0
    # Or the horizon holds only idle finds.
    horizon = ArrivalRate(horizon_s=10.0)
    for second, idle in ((0.0, False), (20.0, True), (21.0, True), (22.0, True)):
        horizon.record(second, 128, found_idle=idle)
    assert horizon.per_second(22.0) == 0.0


def test_online_correction_follows_the_observed_speed():
    tracker = StepTimeTracker(COST, smoothing=0.5)
    prefill = [ChunkAt(0, 100)]
    for _ in range(20):
        tracker.observe(prefill, 2 * COST.predict(100, attention_pairs(0, 100)))
    assert tracker.correction == pytest.approx(2.0, rel=1e-3)
    assert tracker.model.predict(10, 0) == pytest.approx(2 * COST.predict(10, 0))
    for _ in range(50):
        tracker.observe(prefill, 1000.0)
    assert tracker.correction == pytest.approx(StepTimeTracker.MAX_CORRECTION, rel=1e-3)


@dataclass(frozen=True)
class ChunkAt:
    start_position: int
    num_tokens: int


def test_a_decode_row_and_its_pairs_have_their_own_price():
    """One-token chunks pay a token's price, a decode row's and the decode price per pair;
    longer chunks a token's and the prefill's price per pair."""
    model = StepCostModel(0.01, 1e-4, 1e-7, seconds_per_decode_row=1e-3, seconds_per_decode_pair=1e-6)
    step = [ChunkAt(0, 64), ChunkAt(500, 1), ChunkAt(300, 1)]
    assert step_work(step) == (64, attention_pairs(0, 64), 2, 501 + 301)
    expected = 0.01 + 66 * 1e-4 + attention_pairs(0, 64) * 1e-7 + 2 * 1e-3 + 802 * 1e-6
    assert model.predict_chunks(step) == pytest.approx(expected)
    assert model.decode_step(2, 802) == pytest.approx(0.01 + 2e-4 + 2e-3 + 802e-6)
    unmeasured = StepCostModel(seconds_fixed=0.01, seconds_per_token=1e-4, seconds_per_attention_pair=1e-7)
    assert unmeasured.predict(0, 0, 1, 1000) == unmeasured.predict(1, 1000)
    assert model.scaled(2.0).seconds_per_decode_pair == pytest.approx(2e-6)
    assert model.scaled(2.0).seconds_per_decode_row == pytest.approx(2e-3)


def test_attention_pairs_counts_every_query_key_pair():
    assert attention_pairs(0, 3) == 1 + 2 + 3
    assert attention_pairs(10, 2) == 11 + 12


def test_a_plan_covers_the_prompt_in_steps_within_the_bound():
    from firsttoken.core.policy import plan_prefill

    short = plan_prefill(300, 0, 500, COST, TARGETS)
    assert short.chunk_tokens == [300]  # it fits the bound: one step
    busy = plan_prefill(3000, 16, 500, COST, TARGETS)
    assert sum(busy.chunk_tokens) == 3000 and len(busy.chunk_tokens) > 2
    limit = 20 * decode_step_seconds(load_of(num_decodes=16, decode_attention_pairs=16 * 501), COST)
    # Every step but a short tail's stays within the bound.
    assert all(seconds <= limit + 1e-9 for seconds in busy.step_seconds[:-1])
    assert busy.prefill_seconds == pytest.approx(sum(busy.step_seconds))


def test_a_burst_is_one_arrival_event_not_a_rate():
    """A batch sent at once is in line already: it says nothing of prompts still to come."""
    rate = ArrivalRate()
    for _ in range(32):
        rate.record(0.0, 512, found_idle=False)
    assert rate.per_second(0.001) == 0.0 and rate.per_second(6.0) == 0.0
    rate.record(2.0, 512, found_idle=False)
    assert rate.per_second(4.0) == pytest.approx(1 / 4.0)


def test_the_measured_decode_step_is_the_unit_when_the_fit_extrapolates_it_short():
    """A fit over prefills of hundreds of tokens may put its fixed cost under a real decode step."""
    measured = StepCostModel(0.005, 0.0002, 1e-9, seconds_one_decode=0.02)
    load = load_of(num_decodes=1, decode_attention_pairs=100)
    assert decode_step_seconds(load, measured) == 0.02
    assert step_limit_seconds(load, measured, TARGETS) == pytest.approx(20 * 0.02)
    busy = load_of(num_decodes=200, decode_attention_pairs=200 * 500)
    assert decode_step_seconds(busy, measured) == pytest.approx(measured.predict(200, 200 * 500))


@pytest.mark.parametrize(
    "options,field",
    [
        ({"max_stall_factor": float("nan")}, "max_stall_factor"),
        ({"max_stall_factor": 0.5}, "max_stall_factor"),
        ({"max_stall_factor": float("inf")}, "max_stall_factor"),
        ({"itl_target_ms": 0.0}, "itl_target_ms"),
        ({"itl_target_ms": float("inf")}, "itl_target_ms"),
    ],
)
def test_a_bad_chunking_option_is_refused_naming_its_field(options, field):
    from firsttoken.config import ChunkedPrefillConfig
    from firsttoken.errors import InvalidInputError

    with pytest.raises(InvalidInputError, match=field):
        ChunkedPrefillConfig(**options)
