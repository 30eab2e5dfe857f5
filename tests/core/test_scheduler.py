"""Scheduler invariants with fake requests and a fake model (no torch)."""

from __future__ import annotations

import pytest

from firsttoken.config import ChunkedPrefillConfig, SchedulerConfig
from firsttoken.core.batch import ModelOutput
from firsttoken.core.cost_model import StepCostModel, StepTimeTracker
from firsttoken.outputs import SampledToken
from firsttoken.core.hashing import root_hash
from firsttoken.core.kv_cache_manager import KVCacheManager
from firsttoken.core.scheduler import Scheduler
from firsttoken.errors import QueueFullError
from firsttoken.request import RequestStatus
from firsttoken.sampling_params import SamplingParams
from tests.core.fakes import EOS, make_request

BLOCK = 4


def make_scheduler(
    num_blocks: int = 64,
    max_num_seqs: int = 8,
    max_batched: int = 64,
    chunk_size: int | str = 16,
    enable_chunking: bool = True,
    aging_steps: int = 32,
    max_model_len: int = 1024,
    caching: bool = True,
    max_waiting: int | None = None,
    step_times: StepTimeTracker | None = None,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_batched, max_waiting_requests=max_waiting
        ),
        ChunkedPrefillConfig(enable=enable_chunking, chunk_size=chunk_size, aging_steps=aging_steps),
        KVCacheManager(num_blocks, BLOCK, enable_caching=caching),
        max_model_len,
        root_hash("fake"),
        step_times,
    )


def step(scheduler: Scheduler, token_for=lambda req_id: 7):
    """One schedule/update round with a fake model that samples `token_for(req_id)`."""
    output = scheduler.schedule()
    sampled = {chunk.req_id: SampledToken(token_for(chunk.req_id)) for chunk in output.chunks if chunk.sample}
    scheduler.update(output, ModelOutput(sampled))
    return output


def run_to_completion(scheduler: Scheduler, max_steps: int = 10_000, token_for=lambda req_id: 7):
    outputs = []
    while scheduler.has_unfinished_requests():
        outputs.append(step(scheduler, token_for))
        assert len(outputs) < max_steps, "scheduler made no progress"
    return outputs


def test_running_decodes_get_a_token_every_step_while_a_long_prompt_prefills():
    scheduler = make_scheduler(num_blocks=256, chunk_size=16, max_batched=64)
    for index in range(4):
        scheduler.add_request(make_request(f"short{index}", 4, max_tokens=50, first_token=10 * index))
    step(scheduler)  # the four short prompts prefill together
    assert all(r.num_output_tokens == 1 for r in scheduler.running)
    scheduler.add_request(make_request("long", 200, max_tokens=2, first_token=1000))
    long_chunks = 0
    while scheduler.requests["long"].num_output_tokens == 0:
        output = step(scheduler)
        by_id = {chunk.req_id: chunk for chunk in output.chunks}
        for index in range(4):
            assert by_id[f"short{index}"].num_tokens == 1
        assert by_id["long"].num_tokens <= 16
        long_chunks += 1
    assert long_chunks == 13  # ceil(200 / 16)


def test_token_budget_is_never_exceeded():
    scheduler = make_scheduler(chunk_size=24, max_batched=32, max_num_seqs=8)
    for index in range(12):
        scheduler.add_request(
            make_request(f"r{index}", 7 + 11 * index, max_tokens=9, first_token=100 * index)
        )
    for output, token_budget in _steps_with_their_token_budgets(scheduler):
        assert output.num_tokens <= token_budget <= 32
        assert len(output.chunks) <= 8


def _steps_with_their_token_budgets(scheduler):
    """Each step to completion, with its token budget: the decodes it may run plus its prefill budget."""
    steps = []
    while scheduler.has_unfinished_requests():
        running_decodes = sum(1 for r in scheduler.running if r.num_uncomputed_tokens == 1)
        output = step(scheduler)
        token_budget = min(
            scheduler.config.max_num_batched_tokens, running_decodes + scheduler.stats.last_prefill_budget
        )
        steps.append((output, token_budget))
    return steps


def test_short_prompts_overtake_remaining_chunks_of_a_long_one():
    scheduler = make_scheduler(chunk_size=16, max_batched=64)
    scheduler.add_request(make_request("long", 200, max_tokens=1, first_token=1000))
    step(scheduler)
    scheduler.add_request(make_request("short", 6, max_tokens=1))
    output = step(scheduler)
    assert output.chunks[0].req_id == "short"
    assert output.chunks[0].num_tokens == 6
    assert scheduler.requests.get("short") is None  # finished after its single token


def _step_with_a_new_short_prompt(scheduler, index):
    """A step after one more short prompt arrives, one that alone fills the prefill budget."""
    scheduler.add_request(make_request(f"s{index}", 8, max_tokens=1, first_token=10 * index))
    return step(scheduler)


def test_aging_bounds_the_wait_of_a_long_prompt_under_a_flood_of_short_ones():
    aging = 6
    scheduler = make_scheduler(
        num_blocks=256, chunk_size=8, max_batched=64, aging_steps=aging, max_num_seqs=8
    )
    scheduler.add_request(make_request("long", 400, max_tokens=1, first_token=5000))
    waited_steps = 0
    for index in range(200):
        output = _step_with_a_new_short_prompt(scheduler, index)
        if any(chunk.req_id == "long" for chunk in output.chunks):
            break
        waited_steps += 1
    assert waited_steps <= aging
    # Served once, it waits afresh: the short prompts get the next step again.
    scheduler.add_request(make_request("next", 8, max_tokens=1, first_token=9000))
    assert "long" not in [chunk.req_id for chunk in step(scheduler).chunks]


def test_an_aged_prompt_shares_steps_with_short_ones():
    """Aging stops a long prompt starving; it does not hand it every step's budget."""
    aging = 4
    scheduler = make_scheduler(
        num_blocks=512, chunk_size=8, max_batched=64, aging_steps=aging, max_num_seqs=8
    )
    scheduler.add_request(make_request("long", 800, max_tokens=1, first_token=5000))
    steps_with_long = 0
    for index in range(40):
        output = _step_with_a_new_short_prompt(scheduler, index)
        steps_with_long += any(chunk.req_id == "long" for chunk in output.chunks)
    # Short prompts delayed by its turns age too and take some turns back.
    assert 40 // (2 * aging) <= steps_with_long <= 40 // aging + 1


def test_lower_priority_value_is_admitted_first():
    scheduler = make_scheduler(chunk_size=8, max_batched=64)
    scheduler.add_request(make_request("low", 8, max_tokens=1, priority=5, first_token=100))
    scheduler.add_request(make_request("high", 8, max_tokens=1, priority=-1, first_token=200))
    scheduler.add_request(make_request("mid", 8, max_tokens=1, priority=0, first_token=300))
    order = [step(scheduler).chunks[0].req_id for _ in range(3)]
    assert order == ["high", "mid", "low"]


def test_preemption_frees_the_newest_request_and_everything_finishes():
    # 12 blocks of 4 tokens; 4 requests that each grow to 20 tokens (5 blocks) cannot all fit.
    scheduler = make_scheduler(num_blocks=12, chunk_size=64, max_batched=64, caching=False)
    requests = [make_request(f"r{index}", 8, max_tokens=12, first_token=100 * index) for index in range(4)]
    for request in requests:
        scheduler.add_request(request)
    run_to_completion(scheduler)
    assert scheduler.stats.num_preemptions > 0
    assert scheduler.kv_manager.pool.num_free_blocks == 12
    preempted = [request.req_id for request in requests if request.num_preemptions > 0]
    assert "r0" not in preempted  # the oldest request is never the victim


def test_eos_and_max_tokens_stop_and_free_blocks():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("eos", 5, max_tokens=10))
    scheduler.add_request(make_request("length", 5, max_tokens=3, first_token=500))
    finished = {}
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        sampled = {c.req_id: SampledToken(EOS if c.req_id == "eos" else 9) for c in output.chunks if c.sample}
        for progress in scheduler.update(output, ModelOutput(sampled)):
            if progress.request.is_finished:
                finished[progress.request.req_id] = progress.request
    assert finished["eos"].status is RequestStatus.FINISHED_STOPPED
    assert finished["eos"].output_token_ids == [EOS]
    assert finished["length"].status is RequestStatus.FINISHED_LENGTH
    assert finished["length"].num_output_tokens == 3
    assert scheduler.kv_manager.pool.num_free_blocks == 64


def test_without_chunking_a_prompt_runs_whole_even_past_the_budget():
    scheduler = make_scheduler(enable_chunking=False, max_batched=16)
    scheduler.add_request(make_request("long", 40, max_tokens=1))
    scheduler.add_request(make_request("short", 4, max_tokens=1, first_token=900))
    first = step(scheduler)
    assert [(c.req_id, c.num_tokens) for c in first.chunks] == [("short", 4)]
    second = step(scheduler)
    assert [(c.req_id, c.num_tokens) for c in second.chunks] == [("long", 40)]


def test_abort_frees_blocks_of_waiting_and_running_requests():
    scheduler = make_scheduler(chunk_size=8)
    scheduler.add_request(make_request("running", 30, max_tokens=4))
    step(scheduler)
    scheduler.add_request(make_request("waiting", 5, max_tokens=4, first_token=700))
    assert scheduler.finish_request("running", RequestStatus.FINISHED_ABORTED) is not None
    assert scheduler.finish_request("waiting", RequestStatus.FINISHED_ABORTED) is not None
    assert not scheduler.has_unfinished_requests()
    assert scheduler.kv_manager.pool.num_free_blocks == 64


def test_impossible_requests_are_refused_up_front():
    scheduler = make_scheduler(num_blocks=4, max_model_len=100)
    with pytest.raises(ValueError, match="max_model_len"):
        scheduler.add_request(make_request("too-long", 95, max_tokens=10))
    with pytest.raises(ValueError, match="KV blocks"):
        scheduler.add_request(make_request("too-big", 10, max_tokens=10))
    assert not scheduler.has_unfinished_requests()


def test_a_request_that_cannot_fit_beside_pinned_blocks_is_refused_up_front():
    """Pinned blocks are never evicted: a request needing more than the rest is refused at once,
    holding nothing, instead of waiting until someone unpins."""
    scheduler = make_scheduler(num_blocks=16, chunk_size=64)
    to_pin = make_request("to-pin", 32, max_tokens=1)
    scheduler.add_request(to_pin)
    run_to_completion(scheduler)
    assert scheduler.kv_manager.pin("pin", to_pin.block_hashes[:8]) == 32
    too_big = make_request("too-big", 30, max_tokens=6, first_token=500)  # 9 blocks of the 8 left
    with pytest.raises(ValueError, match="^max_tokens: .*pinned prefixes hold 8 of the 16, leaving 8"):
        scheduler.add_request(too_big)
    assert not scheduler.has_unfinished_requests() and too_big.block_hashes == []
    scheduler.add_request(make_request("fits", 28, max_tokens=4, first_token=500))  # 8 blocks
    run_to_completion(scheduler)
    assert scheduler.kv_manager.pool.num_free_blocks == 8


def test_full_waiting_queue_raises_queue_full():
    scheduler = make_scheduler(max_waiting=2)
    scheduler.add_request(make_request("a", 4))
    scheduler.add_request(make_request("b", 4))
    with pytest.raises(QueueFullError):
        scheduler.add_request(make_request("c", 4))


def test_prefix_cache_hit_skips_prefill_of_shared_blocks():
    scheduler = make_scheduler(chunk_size=64)
    shared = list(range(300, 332))  # 8 full blocks
    scheduler.add_request(make_request("first", 0, max_tokens=1, prompt=shared + [1, 2]))
    run_to_completion(scheduler)
    scheduler.add_request(make_request("second", 0, max_tokens=1, prompt=shared + [3, 4, 5]))
    output = step(scheduler)
    assert output.chunks[0].start_position == 32
    assert output.chunks[0].num_tokens == 3


def test_auto_budget_keeps_steps_with_decodes_within_the_stall_bound():
    cost = StepCostModel(seconds_fixed=0.005, seconds_per_token=0.0002, seconds_per_attention_pair=0.0)
    scheduler = make_scheduler(
        num_blocks=2048,
        chunk_size="auto",
        max_batched=2048,
        max_model_len=8192,
        step_times=StepTimeTracker(cost),
    )
    for index in range(4):
        scheduler.add_request(make_request(f"stream{index}", 4, max_tokens=500, first_token=10 * index))
    step(scheduler)
    scheduler.add_request(make_request("long", 4000, max_tokens=1, first_token=1000))
    limit_s = scheduler.chunked_prefill.max_stall_factor * cost.predict(4, 0)
    num_steps = 0
    while "long" in scheduler.requests:
        output = step(scheduler)
        num_steps += 1
        assert sum(1 for chunk in output.chunks if chunk.num_tokens == 1) >= 4
        assert cost.predict(output.num_tokens, 0) <= limit_s + 1e-9
    assert num_steps == -(-4000 // int((limit_s - cost.predict(4, 0)) / cost.seconds_per_token))


def test_auto_budget_alone_bounds_the_step_by_one_decode_step_s_multiple():
    """Nothing decodes, but a prompt arriving during the step would wait for all of it."""
    cost = StepCostModel(0.005, 0.0002, 0.0)
    scheduler = make_scheduler(
        num_blocks=2048,
        chunk_size="auto",
        max_batched=1024,
        max_model_len=8192,
        step_times=StepTimeTracker(cost),
    )
    scheduler.add_request(make_request("long", 3000, max_tokens=1))
    limit_s = scheduler.chunked_prefill.max_stall_factor * cost.predict(1, 1)
    assert step(scheduler).chunks[0].num_tokens == int(
        (limit_s - cost.predict(0, 0)) / cost.seconds_per_token
    )
    short = make_request("short", 40, max_tokens=1, first_token=9000)
    scheduler.add_request(short)
    output = step(scheduler)
    # It overtakes the long one, which adds no more than delays the short one by a decode step.
    assert [chunk.req_id for chunk in output.chunks] == ["short", "long"]
    assert 0 < output.chunks[1].num_tokens * cost.seconds_per_token <= cost.predict(1, 1) + 1e-9
    assert short.num_output_tokens == 1


def test_auto_gives_long_prompts_steps_of_their_own_and_lets_short_ones_share():
    """Sharing a step delays the first tokens already in it by the newcomer's compute, and
    spares the newcomer (and those behind it) a step of ~5.2 ms: four prompts of 600 tokens
    (120 ms each) go one a step, while prompts of 10 tokens (2 ms) share, up to the fourth,
    which would delay three first tokens by 2 ms each to spare itself one step."""

    def first_step_of(num_prompt_tokens: int) -> list[str]:
        scheduler = make_scheduler(
            num_blocks=2048,
            chunk_size="auto",
            max_batched=4096,
            max_model_len=8192,
            step_times=StepTimeTracker(StepCostModel(0.005, 0.0002, 0.0)),
        )
        for index in range(4):
            scheduler.add_request(
                make_request(f"p{index}", num_prompt_tokens, max_tokens=1, first_token=1000 * index)
            )
        return [chunk.req_id for chunk in step(scheduler).chunks]

    assert first_step_of(600) == ["p0"]
    assert first_step_of(10) == ["p0", "p1", "p2"]


def test_fixed_chunks_pack_the_budget_as_they_always_did():
    scheduler = make_scheduler(num_blocks=2048, chunk_size=2048, max_batched=4096, max_model_len=8192)
    for index in range(4):
        scheduler.add_request(make_request(f"p{index}", 600, max_tokens=1, first_token=1000 * index))
    assert [chunk.num_tokens for chunk in step(scheduler).chunks] == [600, 600, 600, 248]


# -- requests the sampler tracks (penalties, bad words, min_tokens) -----------------------------------


def _tracked(req_id: str, num_prompt_tokens: int = 6, max_tokens: int = 4):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, frequency_penalty=0.5)
    return make_request(req_id, num_prompt_tokens, max_tokens=max_tokens, sampling_params=params)


def test_a_tracked_request_is_sent_once_with_its_first_chunk_and_released_at_its_end():
    scheduler = make_scheduler(chunk_size=4)
    tracked = _tracked("tracked")
    scheduler.add_request(tracked)
    scheduler.add_request(make_request("plain", 6, first_token=300))
    outputs = run_to_completion(scheduler)
    sent = [request for output in outputs for request in output.new_tracked_requests]
    assert [request.req_id for request in sent] == ["tracked"]
    assert outputs[0].new_tracked_requests == sent  # with the step of its first chunk
    assert sent[0].prompt_token_ids == tracked.prompt_token_ids
    assert sent[0].stop_token_ids == (EOS,)
    assert scheduler.take_finished_tracked() == ["tracked"]
    assert scheduler.take_finished_tracked() == []


def test_a_tracked_request_ended_before_it_was_sent_is_never_released():
    scheduler = make_scheduler()
    scheduler.add_request(_tracked("waiting"))
    scheduler.finish_request("waiting", RequestStatus.FINISHED_ABORTED)
    assert scheduler.schedule().new_tracked_requests == []
    assert scheduler.take_finished_tracked() == []


def test_a_preempted_tracked_request_is_not_sent_again():
    scheduler = make_scheduler(num_blocks=12, chunk_size=64, max_batched=64, caching=False)
    requests = [_tracked(f"r{index}", 8, max_tokens=12) for index in range(4)]
    for request in requests:
        scheduler.add_request(request)
    outputs = run_to_completion(scheduler)
    assert scheduler.stats.num_preemptions > 0
    sent = [request.req_id for output in outputs for request in output.new_tracked_requests]
    assert sorted(sent) == ["r0", "r1", "r2", "r3"]
    assert sorted(scheduler.take_finished_tracked()) == sorted(sent)


def test_stop_ids_sent_for_min_tokens_leave_out_an_ignored_eos():
    scheduler = make_scheduler()
    params = SamplingParams(max_tokens=4, min_tokens=2, ignore_eos=True, stop_token_ids=[9, 5])
    scheduler.add_request(make_request("r", 6, max_tokens=4, sampling_params=params))
    (sent,) = scheduler.schedule().new_tracked_requests
    assert sent.stop_token_ids == (5, 9)
