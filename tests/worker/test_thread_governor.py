"""The thread governor against a simulated machine: quiet, then one core taken, then quiet."""

from __future__ import annotations

from firsttoken import SamplingParams
from firsttoken.worker.thread_governor import ThreadGovernor

STEP_S = 0.05  # predicted (quiet, every thread) step time


def run(
    governor: ThreadGovernor, slowness_by_threads: dict[int, float], clock: list[float], steps: int
) -> list[int]:
    """Steps on the governor's choice, each `slowness_by_threads[threads]` times the prediction."""
    chosen = []
    for _ in range(steps):
        threads = governor.threads()
        seconds = STEP_S * slowness_by_threads[threads]
        clock[0] += seconds
        governor.observe(threads, seconds, STEP_S, clock[0])
        chosen.append(threads)
    return chosen


QUIET = {1: 2.0, 2: 1.0}  # compute-bound: one thread takes twice as long
CONTENDED = {1: 1.9, 2: 2.8}  # the second core shared: its thread straggles


def test_a_quiet_machine_keeps_every_thread():
    governor = ThreadGovernor(2)
    assert set(run(governor, QUIET, [0.0], 500)) == {2}


def test_noise_below_the_contention_bound_never_probes():
    governor = ThreadGovernor(2, contention_slowness=1.3)
    assert set(run(governor, {1: 2.4, 2: 1.25}, [0.0], 500)) == {2}


def test_contention_moves_to_fewer_threads_and_quiet_brings_them_back():
    governor = ThreadGovernor(2)
    clock = [0.0]
    run(governor, QUIET, clock, 50)
    contended = run(governor, CONTENDED, clock, 400)
    assert governor.current_threads == 1
    # Settled within the first windows; afterwards only short probes of 2 threads.
    assert contended[20:].count(1) > 0.9 * len(contended[20:])
    run(governor, QUIET, clock, 400)
    assert governor.current_threads == 2


def test_more_cores_give_up_only_the_busy_one():
    # 8 cores, one busy: 7 threads run at 8/7 of the quiet time, 8 wait on a straggler.
    slowness = {n: 8 / n * (1.0 if n <= 7 else 1.8) for n in range(1, 9)}
    governor = ThreadGovernor(8, reprobe_interval_s=0.5)
    run(governor, slowness, [0.0], 2000)
    assert governor.current_threads == 7


def test_steps_on_another_thread_count_are_ignored():
    governor = ThreadGovernor(2)
    for _ in range(100):
        governor.observe(1, 10.0, STEP_S, 0.0)
    assert governor.threads() == 2


def test_an_engine_measures_only_the_steps_its_cost_model_predicts(
    engine_for, two_layer_model_path, monkeypatch
):
    """A step that scores prompt tokens pays an LM head per scored row, which the step cost model
    does not predict: measured, it would read as contention and cost the next steps a thread."""
    llm = engine_for(model=two_layer_model_path, dtype="float32", adaptive_threads=True, num_threads=2)
    governor = llm.core.worker.thread_governor
    observed = []
    monkeypatch.setattr(
        governor, "observe", lambda threads, seconds, predicted, now: observed.append(threads)
    )
    prompt = [[token_id % 5000 + 100 for token_id in range(300)]]
    llm.generate(prompt_token_ids=prompt, sampling_params=SamplingParams(max_tokens=1, prompt_logprobs=1))
    assert observed == []
    llm.generate(prompt_token_ids=prompt, sampling_params=SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(observed) == 3  # the prefill and two decodes
