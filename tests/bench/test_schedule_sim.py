"""The served A/B of chunk policies on a simulated clock: the real scheduler, each step taking what
a CPU class's measured step-cost model predicts, Poisson arrivals at fractions of that device's
capacity. `auto` must never lose to the best fixed chunk (the one with the lowest TTFT P50 at
that point) by more than 10% on TTFT P50 or on TPOT P50."""

from __future__ import annotations

import math

import pytest

from firsttoken.bench.schedule_sim import (
    SimulatedArrival,
    SimulatedLoad,
    poisson_arrivals,
    saturated_rate,
    simulate,
    sweep_chunk_policies,
)
from firsttoken.config import ChunkedPrefillConfig
from firsttoken.core.cost_model import StepCostModel

# Step costs of SmolLM2-135M in each CPU class's default dtype, 2 cores:
# - Zen 4 (AVX512-BF16, no AMX), bf16: the start-up calibration's fit, measured (a 512-token
#   prefill 347 ms, a one-row decode step 24 ms).
# - Emerald Rapids without AMX, float32: fitted to its measured TTFT at 128 / 512 / 2048 tokens
#   (160 / 568 / 3724 ms).
# - First-generation Zen (AVX2), float32: fitted to its TTFT at 128 / 512 / 2048 tokens (541 / 2070
#   / 11415 ms).
# - Zen 3 (AVX2), float32 with invariance (its measured default): the start-up calibration's fit
#   (a 512-token prefill ~0.98 s, a one-row decode step 21 ms).
XEON_AMX_BF16 = StepCostModel(
    0.0215, 1.60e-4, 1.04e-7, 0.0284, seconds_per_decode_row=4.5e-4, seconds_per_decode_pair=6.1e-7
)
CPU_CLASSES = {
    "zen4-bf16": StepCostModel(0.0269, 0.000580, 2.27e-7),
    "xeon-no-amx-float32": pytest.param(StepCostModel(0.058, 0.000731, 1.03e-6), marks=pytest.mark.slow),
    "zen1-avx2-float32": pytest.param(StepCostModel(0.103, 0.00328, 2.19e-6), marks=pytest.mark.slow),
    "zen3-avx2-float32": pytest.param(
        StepCostModel(0.0547, 0.00161, 5.79e-7, seconds_one_decode=0.0206, seconds_per_decode_pair=4.40e-6),
        marks=pytest.mark.slow,
    ),
    # Decode rows and their pairs priced apart (a 2-core Xeon with AMX, the embedded model in bf16).
    "xeon-amx-bf16": pytest.param(XEON_AMX_BF16, marks=pytest.mark.slow),
}
FIXED_CHUNKS = (256, 512, 1024, 2048)
SETTINGS = {
    "auto": ChunkedPrefillConfig(),
    **{str(chunk): ChunkedPrefillConfig(chunk_size=chunk) for chunk in FIXED_CHUNKS},
}
LOADS = (
    SimulatedLoad(512, 64, num_requests=80, rate=0.0),
    SimulatedLoad(2048, 128, num_requests=40, rate=0.0),
)
MARGIN = 1.10


@pytest.mark.parametrize("cost_model", list(CPU_CLASSES.values()), ids=list(CPU_CLASSES))
def test_auto_never_loses_to_the_best_fixed_chunk(cost_model: StepCostModel):
    losses = []
    for point in sweep_chunk_policies(cost_model, LOADS, (0.5, 1.0, 1.5), SETTINGS):
        auto = point.of("auto")
        best = min((point.of(str(chunk)) for chunk in FIXED_CHUNKS), key=lambda figures: figures.ttft_p50_ms)
        if auto.ttft_p50_ms > MARGIN * best.ttft_p50_ms or auto.tpot_p50_ms > MARGIN * best.tpot_p50_ms:
            losses.append(
                f"{point.load.input_len}/{point.load.output_len} at {point.capacity_fraction}x capacity: "
                f"auto TTFT P50 {auto.ttft_p50_ms:.0f} ms, TPOT P50 {auto.tpot_p50_ms:.0f} ms; "
                f"fixed {best.label} {best.ttft_p50_ms:.0f} / {best.tpot_p50_ms:.0f} ms"
            )
    assert not losses, "\n".join(losses)


def test_a_short_prompt_after_a_long_one_waits_only_for_the_step_in_flight():
    """A 3000-token prompt, then 0.3 s later a 32-token one: whole 2048-token steps keep the short
    one waiting for the long prompt's first step; auto's steps are a bounded multiple of a decode
    step, and the short prompt overtakes the rest of the long one."""
    cost_model = CPU_CLASSES["zen4-bf16"]
    arrivals = [SimulatedArrival(0.0, 3000, 1), SimulatedArrival(0.3, 32, 1)]
    ttft_s = {
        label: simulate(cost_model, arrivals, ChunkedPrefillConfig(chunk_size=chunk)).records[1].ttft_s
        for label, chunk in (("auto", "auto"), ("whole", 2048))
    }
    decode_step_s = cost_model.predict(1, 1)
    assert ttft_s["auto"] <= ChunkedPrefillConfig().max_stall_factor * decode_step_s + 2 * decode_step_s
    assert ttft_s["auto"] <= 0.5 < ttft_s["whole"]


def test_a_lone_request_takes_what_the_cost_model_says():
    cost_model = StepCostModel(0.01, 0.001, 0.0)
    run = simulate(cost_model, [SimulatedArrival(2.0, 100, 3)], ChunkedPrefillConfig(chunk_size=2048))
    (record,) = run.records
    assert record.ttft_s == pytest.approx(cost_model.predict(100, 0))
    assert record.tpot_s == pytest.approx(cost_model.predict(1, 0))
    assert run.num_steps == 3 and run.duration_s == pytest.approx(record.latency_s)


def test_capacity_is_the_burst_rate_and_arrivals_follow_the_client():
    cost_model = CPU_CLASSES["zen4-bf16"]
    load = SimulatedLoad(512, 64, num_requests=50, rate=2.0, seed=3, long_fraction=0.2, long_input_len=1024)
    arrivals = poisson_arrivals(load)
    assert arrivals == poisson_arrivals(load)  # seeded
    assert arrivals[0].arrival_s == 0.0 and all(
        a.arrival_s <= b.arrival_s for a, b in zip(arrivals, arrivals[1:])
    )
    assert {arrival.input_len for arrival in arrivals} == {512, 1024}
    capacity = saturated_rate(cost_model, SimulatedLoad(512, 64, num_requests=1, rate=math.inf))
    # Prefill alone bounds it: one 512-token prompt's compute per request, at most.
    assert 0 < capacity < 1 / (cost_model.seconds_per_token * 512) * 1.5
