"""The scheduler's side of speculative decoding, with a fake proposer and a fake model: the
scheduler names the decodes to draft for, and verifies the drafts in the next step."""

from __future__ import annotations

from firsttoken.config import ChunkedPrefillConfig, SchedulerConfig
from firsttoken.core.batch import ModelOutput, SchedulerOutput
from firsttoken.core.hashing import root_hash
from firsttoken.core.kv_cache_manager import KVCacheManager
from firsttoken.core.scheduler import Scheduler
from firsttoken.outputs import SampledToken
from firsttoken.sampling_params import SamplingParams, StructuredOutput
from tests.core.fakes import EOS, make_request

BLOCK = 4


class FixedProposer:
    def __init__(self, proposal: list[int]) -> None:
        self.proposal = proposal

    def propose_batch(self, token_ids: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
        return [self.proposal[:limit] for limit in max_tokens]


class SpeculatingScheduler:
    """A scheduler and a proposer stepped as EngineCore steps them: after each update, the
    proposer drafts for the decodes the scheduler names, and the next schedule verifies them."""

    def __init__(self, scheduler: Scheduler, proposer: FixedProposer) -> None:
        self.scheduler = scheduler
        self.proposer = proposer

    def propose_drafts(self) -> None:
        slots = self.scheduler.draft_slots()
        proposals = self.proposer.propose_batch(
            [slot.request.token_ids for slot in slots], [slot.max_tokens for slot in slots]
        )
        for slot, proposal in zip(slots, proposals):
            slot.request.draft_token_ids = proposal


def make_scheduler(
    proposal: list[int], num_blocks: int = 64, max_speculating: int = 8
) -> SpeculatingScheduler:
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64),
        ChunkedPrefillConfig(chunk_size=16),
        KVCacheManager(num_blocks, BLOCK, enable_caching=True),
        1024,
        root_hash("fake"),
        max_num_speculating_seqs=max_speculating,
    )
    return SpeculatingScheduler(scheduler, FixedProposer(proposal))


def model_step(speculating: SpeculatingScheduler, choose) -> SchedulerOutput:
    """One step with a fake model whose token after position p of request r is choose(r, p)."""
    scheduler = speculating.scheduler
    output = scheduler.schedule()
    sampled, verified = {}, {}
    for chunk in output.chunks:
        if chunk.sample is None:
            continue
        last_row = chunk.start_position + chunk.num_tokens - 1 - chunk.num_draft_tokens
        rows = range(last_row, last_row + 1 + chunk.num_draft_tokens)
        tokens = [SampledToken(choose(chunk.req_id, position)) for position in rows]
        sampled[chunk.req_id] = tokens[0]
        if chunk.num_draft_tokens:
            verified[chunk.req_id] = tokens[1:]
    scheduler.update(output, ModelOutput(sampled, verified))
    speculating.propose_drafts()
    return output


def test_accepts_the_agreeing_prefix_plus_the_models_next_token_and_hashes_only_accepted_tokens():
    speculating = make_scheduler(proposal=[21, 22, 99, 24])
    scheduler = speculating.scheduler
    request = make_request("r", 8, max_tokens=20)
    scheduler.add_request(request)
    # The model continues 20, 21, 22, 23, ... after the prompt.
    model_step(speculating, lambda req_id, position: 20 + position - 7)
    assert request.output_token_ids == [20]
    output = model_step(speculating, lambda req_id, position: 20 + position - 7)
    (chunk,) = output.chunks
    assert chunk.token_ids == [20, 21, 22, 99, 24] and chunk.num_draft_tokens == 4
    # 21 and 22 agree; at 99 the model says 23: three new tokens, 99's KV is not computed.
    assert request.output_token_ids == [20, 21, 22, 23]
    assert request.num_computed_tokens == 8 + 3
    assert request.num_uncomputed_tokens == 1
    stats = scheduler.stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 4, 2)
    assert stats.accepted_per_position == [1, 1, 0, 0]
    # Only blocks full of accepted tokens are cached; blocks past the sequence went back.
    blocks = scheduler.kv_manager.block_ids("r")
    assert len(blocks) == -(-request.num_tokens // BLOCK)
    assert scheduler.kv_manager._num_registered_blocks["r"] == request.num_computed_tokens // BLOCK


def test_never_overshoots_max_tokens_and_stops_at_eos_inside_the_accepted_run():
    speculating = make_scheduler(proposal=[5, 5, 5, 5])
    scheduler = speculating.scheduler
    capped = make_request("capped", 4, max_tokens=3)
    scheduler.add_request(capped)
    while scheduler.has_unfinished_requests():
        model_step(speculating, lambda req_id, position: 5)
    assert capped.output_token_ids == [5, 5, 5]

    speculating = make_scheduler(proposal=[5, EOS, 5, 5])
    scheduler = speculating.scheduler
    stopped = make_request("stopped", 4, max_tokens=50)
    scheduler.add_request(stopped)
    model_step(speculating, lambda req_id, position: 5)
    model_step(speculating, lambda req_id, position: EOS if position == 5 else 5)
    assert stopped.output_token_ids == [5, 5, EOS] and stopped.is_finished
    assert scheduler.kv_manager.pool.num_free_blocks == 64


def test_speculates_only_without_waiting_prefills_and_within_the_seq_limit():
    speculating = make_scheduler(proposal=[1, 2], max_speculating=1)
    scheduler = speculating.scheduler
    scheduler.add_request(make_request("a", 4, max_tokens=10))
    model_step(speculating, lambda req_id, position: 9)
    scheduler.add_request(make_request("b", 4, max_tokens=10, first_token=300))
    output = model_step(speculating, lambda req_id, position: 9)
    assert all(chunk.num_draft_tokens == 0 for chunk in output.chunks)  # b was waiting
    output = model_step(speculating, lambda req_id, position: 9)
    assert len(output.chunks) == 2 and all(
        chunk.num_draft_tokens == 0 for chunk in output.chunks
    )  # two decodes > 1


def test_proposals_never_preempt_and_take_only_free_blocks():
    speculating = make_scheduler(proposal=[1, 2, 3, 4], num_blocks=4)
    scheduler = speculating.scheduler
    request = make_request("r", 6, max_tokens=10)
    scheduler.add_request(request)
    model_step(speculating, lambda req_id, position: 9)
    held_elsewhere = scheduler.kv_manager.pool.allocate(scheduler.kv_manager.pool.num_free_blocks)
    output = model_step(speculating, lambda req_id, position: 9)  # the proposals would need a third block
    assert output.chunks[0].num_draft_tokens == 0
    assert scheduler.stats.num_preemptions == 0 and request.output_token_ids == [9, 9]
    scheduler.kv_manager.pool.release(held_elsewhere)
    output = model_step(speculating, lambda req_id, position: 9)
    assert output.chunks[0].num_draft_tokens == 4


def test_a_constrained_request_never_speculates_and_its_grammar_reaches_the_sampler():
    """A grammar's matcher advances only with tokens fed back as inputs, never with proposals:
    a structured-output request decodes one token a step beside one that speculates, and the
    step that first schedules it hands its (here stand-in) compiled grammar to the sampler."""
    speculating = make_scheduler(proposal=[1, 2], max_speculating=8)
    scheduler = speculating.scheduler
    grammar = object()
    constrained = SamplingParams(
        max_tokens=10, temperature=0, structured_output=StructuredOutput(json_object=True)
    )
    request = make_request("json", 4, sampling_params=constrained)
    request.grammar = grammar
    scheduler.add_request(request)
    scheduler.add_request(make_request("free", 4, max_tokens=10, first_token=300))
    first = model_step(speculating, lambda req_id, position: 9)
    assert [(tracked.req_id, tracked.grammar) for tracked in first.new_tracked_requests] == [
        ("json", grammar)
    ]
    for _ in range(3):
        output = model_step(speculating, lambda req_id, position: 9)
        drafts = {chunk.req_id: chunk.num_draft_tokens for chunk in output.chunks}
        assert drafts["json"] == 0 and drafts["free"] > 0


def test_a_draft_is_verified_in_the_next_step_or_never():
    """Drafts proposed after a step wait for no later one: a prompt arriving before the next
    step stops that step from verifying them, and they are dropped, not kept for after."""
    speculating = make_scheduler(proposal=[1, 2])
    scheduler = speculating.scheduler
    request = make_request("a", 4, max_tokens=10)
    scheduler.add_request(request)
    model_step(speculating, lambda req_id, position: 9)
    assert request.draft_token_ids == [1, 2]
    scheduler.add_request(make_request("b", 4, max_tokens=10, first_token=300))
    output = scheduler.schedule()
    assert all(chunk.num_draft_tokens == 0 for chunk in output.chunks)
    assert request.draft_token_ids == []


def test_drafts_fit_the_room_left_and_are_not_asked_for_a_tracked_request():
    speculating = make_scheduler(proposal=[1, 2, 3, 4])
    scheduler = speculating.scheduler
    scheduler.add_request(make_request("short", 4, max_tokens=3))
    penalized = SamplingParams(max_tokens=10, temperature=0, repetition_penalty=1.2)
    scheduler.add_request(make_request("tracked", 4, first_token=300, sampling_params=penalized))
    model_step(speculating, lambda req_id, position: 9)
    # One token out of 3: room for one draft and the model's token after it.
    assert [(slot.request.req_id, slot.max_tokens) for slot in scheduler.draft_slots()] == [("short", 1)]
