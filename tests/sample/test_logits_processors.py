"""Logits processors: each batched processor equals a plain per-row Python loop on random logits,
and transformers' processor where one exists; rows without processors are untouched; a row's
result does not depend on its batch; the token counts follow the tokens fed back as inputs."""

from __future__ import annotations

import collections
import dataclasses
import math
import random
from dataclasses import dataclass

import pytest
import torch

from firsttoken.core.batch import SampleSpec, ScheduledChunk, SchedulerOutput, TrackedRequest
from firsttoken.sample.logits_processors import TrackedTokens, apply_logits_processors, bad_word_bans
from firsttoken.sample.sampler import Sampler, candidate_width, filter_logits, find_nucleus
from firsttoken.sampling_params import SamplingParams
from tests.sample.distributions import assert_follows, chi_square_p_value

CPU = torch.device("cpu")
VOCAB = 300
EOS = 2


@dataclass
class Row:
    """One row of a test step: its request's parameters, prompt and tokens generated so far."""

    req_id: str
    params: SamplingParams
    prompt: list[int]
    output: list[int]
    stop_token_ids: tuple[int, ...] = (EOS,)
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()

    @property
    def spec(self) -> SampleSpec:
        return SampleSpec(self.params, len(self.output), self.req_id)

    @property
    def tracked_request(self) -> TrackedRequest:
        return TrackedRequest(
            self.req_id, self.params, self.prompt, self.stop_token_ids, self.bad_words_token_ids
        )


def serving_steps(rows: list[Row]) -> list[SchedulerOutput]:
    """The steps that bring the rows' requests to their outputs, as serving runs them: the
    prompt in one chunk, then each generated token fed back as the input of the next decode."""
    steps = [
        SchedulerOutput(
            [ScheduledChunk(row.req_id, row.prompt, 0, [], None) for row in rows],
            [row.tracked_request for row in rows if row.params.tracks_tokens],
        )
    ]
    for index in range(max((len(row.output) for row in rows), default=0)):
        chunks = [
            ScheduledChunk(row.req_id, [row.output[index]], len(row.prompt) + index, [], None)
            for row in rows
            if index < len(row.output)
        ]
        steps.append(SchedulerOutput(chunks))
    return steps


def track_by_decodes(rows: list[Row], device: torch.device = CPU) -> TrackedTokens:
    tracked = TrackedTokens(VOCAB, device)
    for step in serving_steps(rows):
        tracked.add(step.new_tracked_requests)
        tracked.observe(step.chunks)
    return tracked


def processed(logits: torch.Tensor, rows: list[Row]) -> torch.Tensor:
    """The rows' logits after the processors, on the logits' device."""
    result = logits.clone()
    apply_logits_processors(result, [row.spec for row in rows], track_by_decodes(rows, logits.device))
    return result


def random_tokens(rng: random.Random, count: int) -> list[int]:
    """Ids from a small range of the vocabulary, so that tokens repeat."""
    return [rng.randrange(0, 60) for _ in range(count)]


def random_logits(num_rows: int, seed: int) -> torch.Tensor:
    return torch.randn(num_rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


# -- plain references: one row, a Python loop over its tokens -----------------------------------


def reference_penalties(logits: list[float], row: Row) -> list[float]:
    params = row.params
    counts = collections.Counter(row.output)
    seen = set(row.prompt) | set(row.output)
    result = []
    for token_id, logit in enumerate(logits):
        if token_id in seen:
            if logit > 0:
                logit = logit / params.repetition_penalty
            else:
                logit = logit * params.repetition_penalty
        logit -= params.frequency_penalty * counts[token_id]
        if counts[token_id] > 0:
            logit -= params.presence_penalty
        result.append(logit)
    return result


def reference_logit_bias(logits: list[float], row: Row) -> list[float]:
    bias = row.params.logit_bias or {}
    return [logit + bias.get(token_id, 0.0) for token_id, logit in enumerate(logits)]


def reference_bans(logits: list[float], row: Row) -> list[float]:
    banned = set()
    for word in row.bad_words_token_ids:
        *prefix, last = word
        if len(prefix) <= len(row.output) and (not prefix or row.output[-len(prefix) :] == prefix):
            banned.add(last)
    if len(row.output) < row.params.min_tokens:
        banned |= set(row.stop_token_ids)
    return [-math.inf if token_id in banned else logit for token_id, logit in enumerate(logits)]


def reference_row(logits: list[float], row: Row) -> list[float]:
    """vLLM's order: bans, logit bias, then penalties."""
    return reference_penalties(reference_logit_bias(reference_bans(logits, row), row), row)


def random_row(rng: random.Random, index: int) -> Row:
    """A row using a random subset of the processors (perhaps none)."""
    params = {}
    if rng.random() < 0.5:
        params["repetition_penalty"] = rng.choice([0.5, 1.3, 2.0])
    if rng.random() < 0.5:
        params["frequency_penalty"] = rng.uniform(-2, 2)
    if rng.random() < 0.5:
        params["presence_penalty"] = rng.uniform(-2, 2)
    if rng.random() < 0.4:
        params["logit_bias"] = {
            rng.randrange(VOCAB): rng.uniform(-100, 100) for _ in range(rng.randrange(1, 6))
        }
    if rng.random() < 0.4:
        params["min_tokens"] = rng.randrange(0, 12)
    output = random_tokens(rng, rng.randrange(0, 10))
    bad_words: tuple[tuple[int, ...], ...] = ()
    if rng.random() < 0.4:
        params["bad_words"] = ("placeholder",)  # the engine tokenizes words; here ids are given
        # Some words end where the output ends, so that their last token is banned.
        bad_words = tuple(
            tuple(output[len(output) - length + 1 :] + [rng.randrange(VOCAB)])
            if rng.random() < 0.5 and length - 1 <= len(output)
            else tuple(random_tokens(rng, length))
            for length in (rng.randrange(1, 4) for _ in range(3))
        )
    return Row(
        f"r{index}",
        SamplingParams(temperature=rng.choice([0.0, 0.8]), max_tokens=16, **params),
        random_tokens(rng, rng.randrange(1, 30)),
        output,
        stop_token_ids=(EOS, rng.randrange(VOCAB)),
        bad_words_token_ids=bad_words,
    )


# -- every processor against its plain reference --------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_processed_rows_equal_the_plain_reference(seed):
    rng = random.Random(seed)
    rows = [random_row(rng, index) for index in range(12)]
    logits = random_logits(len(rows), seed)
    result = processed(logits, rows)
    for index, row in enumerate(rows):
        expected = torch.tensor(reference_row(logits[index].tolist(), row), dtype=torch.float32)
        torch.testing.assert_close(result[index], expected, rtol=1e-5, atol=1e-5, msg=str(row))


@pytest.mark.parametrize(
    "params",
    [
        dict(repetition_penalty=1.5),
        dict(frequency_penalty=0.7),
        dict(presence_penalty=-1.2),
        dict(repetition_penalty=0.8, frequency_penalty=-0.3, presence_penalty=2.0),
        dict(logit_bias={5: 100.0, 9: -100.0, 17: 3.5}),
        dict(min_tokens=5),
    ],
    ids=["repetition", "frequency", "presence", "all penalties", "logit_bias", "min_tokens"],
)
def test_each_processor_alone_equals_the_reference(params):
    rng = random.Random(7)
    rows = [
        Row(
            f"r{index}",
            SamplingParams(max_tokens=8, **params),
            random_tokens(rng, 20),
            random_tokens(rng, index),
        )
        for index in range(6)
    ]
    logits = random_logits(len(rows), 8)
    result = processed(logits, rows)
    for index, row in enumerate(rows):
        expected = torch.tensor(reference_row(logits[index].tolist(), row), dtype=torch.float32)
        torch.testing.assert_close(result[index], expected, rtol=1e-5, atol=1e-5)


def test_bad_word_bans_follow_vllms_rule():
    words = ((7,), (3, 4), (1, 2, 5), (9, 9))
    assert bad_word_bans(words, []) == [7]  # a word longer than one token needs its prefix generated
    assert bad_word_bans(words, [3]) == [7, 4]
    assert bad_word_bans(words, [1, 2]) == [7, 5]
    assert bad_word_bans(words, [2, 1, 2]) == [7, 5]
    assert bad_word_bans(words, [1, 3, 2]) == [7]
    assert bad_word_bans(words, [9]) == [7, 9]


# -- against transformers' processors ---------------------------------------------------------------


def _one_row(params: dict, prompt: list[int], output: list[int], **row_fields) -> Row:
    return Row("r", SamplingParams(max_tokens=16, **params), prompt, output, **row_fields)


@pytest.mark.parametrize("penalty", [0.6, 1.0, 1.7])
def test_repetition_penalty_equals_transformers(penalty):
    from transformers import RepetitionPenaltyLogitsProcessor

    rng = random.Random(9)
    rows = [_one_row(dict(repetition_penalty=penalty), random_tokens(rng, 25), random_tokens(rng, 8))]
    logits = random_logits(1, 9)
    input_ids = torch.tensor([rows[0].prompt + rows[0].output])
    expected = RepetitionPenaltyLogitsProcessor(penalty)(input_ids, logits.clone())
    assert torch.equal(processed(logits, rows), expected)


@pytest.mark.parametrize("num_generated", [0, 3, 4, 9])
def test_min_tokens_equals_transformers(num_generated):
    from transformers import MinNewTokensLengthLogitsProcessor

    rng = random.Random(10)
    prompt, output = random_tokens(rng, 12), random_tokens(rng, num_generated)
    rows = [_one_row(dict(min_tokens=4), prompt, output, stop_token_ids=(EOS, 40))]
    logits = random_logits(1, 10)
    transformers_processor = MinNewTokensLengthLogitsProcessor(len(prompt), 4, [EOS, 40])
    expected = transformers_processor(torch.tensor([prompt + output]), logits.clone())
    assert torch.equal(processed(logits, rows), expected)


@pytest.mark.parametrize("seed", range(3))
def test_bad_words_equal_transformers_over_the_generated_tokens(seed):
    from transformers import NoBadWordsLogitsProcessor

    rng = random.Random(seed)
    output = random_tokens(rng, 6)
    words = (
        (output[-1] + 1,),
        tuple(output[-2:] + [11]),
        (output[-1], 12),
        (1, 2, 3),
        tuple(output[-3:] + [99]),
    )
    rows = [_one_row(dict(bad_words=("w",)), random_tokens(rng, 10), output, bad_words_token_ids=words)]
    logits = random_logits(1, seed)
    # vLLM's rule matches words against the generated tokens only: transformers sees just those.
    expected = NoBadWordsLogitsProcessor([list(word) for word in words])(
        torch.tensor([output]), logits.clone()
    )
    assert torch.equal(processed(logits, rows), expected)


def test_logit_bias_equals_transformers_sequence_bias_of_single_tokens():
    from transformers import SequenceBiasLogitsProcessor

    bias = {3: 12.5, 40: -100.0, 299: 100.0, 7: -0.25}
    rows = [_one_row(dict(logit_bias=bias), [1, 2, 3], [4])]
    logits = random_logits(1, 11)
    sequence_bias = [[[token_id], value] for token_id, value in bias.items()]
    expected = SequenceBiasLogitsProcessor(sequence_bias)(torch.tensor([[1, 2, 3, 4]]), logits.clone())
    assert torch.equal(processed(logits, rows), expected)


@pytest.mark.parametrize("min_p", [0.01, 0.1, 0.5, 1.0])
def test_min_p_filter_keeps_what_transformers_keeps(min_p):
    from transformers import MinPLogitsWarper

    logits = random_logits(4, 12)
    expected = MinPLogitsWarper(min_p)(torch.zeros(4, 1, dtype=torch.long), logits.clone())
    for index in range(4):
        ours = filter_logits(logits[index], top_k=-1, top_p=1.0, min_p=min_p)
        assert torch.equal(torch.isfinite(ours), torch.isfinite(expected[index]))


# -- batching --------------------------------------------------------------------------------------


def test_rows_without_processors_are_untouched_beside_processed_rows():
    rng = random.Random(13)
    rows = [random_row(rng, index) for index in range(10)]
    rows[3] = Row("plain", SamplingParams(temperature=0.5), [1, 2, 3], [1, 2])
    logits = random_logits(len(rows), 13)
    assert torch.equal(processed(logits, rows)[3], logits[3])


def test_a_row_is_processed_alike_alone_and_in_any_batch():
    rng = random.Random(14)
    rows = [random_row(rng, index) for index in range(16)]
    logits = random_logits(len(rows), 14)
    for index, row in enumerate(rows):
        alone = processed(logits[index : index + 1], [row])
        order = list(range(len(rows)))
        rng.shuffle(order)
        batched = processed(logits[order], [rows[i] for i in order])
        assert torch.equal(batched[order.index(index)], alone[0])


def test_a_step_without_processors_runs_none(monkeypatch):
    import firsttoken.sample.sampler as sampler_module

    def refuse(*_):
        raise AssertionError("processors ran for rows without any")

    monkeypatch.setattr(sampler_module, "apply_logits_processors", refuse)
    sampler = Sampler(0, CPU, VOCAB)
    specs = [SampleSpec(SamplingParams(temperature=t, top_p=0.9), 0, f"r{t}") for t in (0.0, 0.7)]
    assert len(sampler.sample(random_logits(2, 15), specs)) == 2


# -- the token state -----------------------------------------------------------------------------------


def _seen_token_ids(tracked: TrackedTokens, req_id: str) -> list[int]:
    slot = tracked.requests[req_id].slot
    return tracked.penalties.seen_ids[slot, : tracked.penalties.num_seen[slot]].tolist()


def test_counts_built_step_by_step_equal_one_recompute_chunk():
    rng = random.Random(16)
    rows = [
        Row(
            f"r{i}",
            SamplingParams(frequency_penalty=1.0, repetition_penalty=1.2 if i else 1.0, max_tokens=32),
            random_tokens(rng, 9),
            random_tokens(rng, 20),
        )
        for i in range(3)
    ]
    by_decodes = track_by_decodes(rows)
    recomputed = TrackedTokens(VOCAB, CPU)
    recomputed.add([row.tracked_request for row in rows])
    # A preempted request's recompute: prompt and outputs in one chunk, then the same chunk again.
    chunks = [ScheduledChunk(row.req_id, row.prompt + row.output, 0, [], None) for row in rows]
    recomputed.observe(chunks)
    recomputed.observe(chunks)
    for row in rows:
        expected_counts = torch.bincount(torch.tensor(row.output), minlength=VOCAB).float()
        # Repetition penalizes the prompt's tokens too; the others only the generated ones.
        seen = row.prompt + row.output if row.params.repetition_penalty != 1 else row.output
        for tracked in (by_decodes, recomputed):
            tokens = tracked.requests[row.req_id]
            assert tokens.output_token_ids == row.output
            assert torch.equal(tracked.penalties.output_counts[tokens.slot], expected_counts)
            assert _seen_token_ids(tracked, row.req_id) == list(dict.fromkeys(seen))


def test_a_cached_prompt_prefix_is_still_seen_by_the_repetition_penalty():
    row = _one_row(dict(repetition_penalty=2.0), [5, 6, 5, 7, 8], [])
    tracked = TrackedTokens(VOCAB, CPU)
    tracked.add([row.tracked_request])
    tracked.observe([ScheduledChunk("r", [8], 4, [], None)])  # only the last prompt token runs
    assert _seen_token_ids(tracked, "r") == [5, 6, 7, 8]


def test_growth_keeps_counts_and_seen_tokens_and_a_released_slot_is_reused_empty():
    tracked = TrackedTokens(VOCAB, CPU)
    rows = [
        Row(f"r{index}", SamplingParams(presence_penalty=1.0), [1], list(range(index, index + 10 * index)))
        for index in range(9)
    ]
    for row in rows:
        tracked.add([row.tracked_request])
        tracked.observe([ScheduledChunk(row.req_id, [1] + row.output, 0, [], None)])
    assert tracked.penalties.output_counts.shape[0] == 16  # grown 4 -> 8 -> 16
    assert tracked.penalties.seen_ids.shape[1] == 128  # grown from 64 for the 80 tokens of r8
    for row in rows:
        slot = tracked.requests[row.req_id].slot
        assert tracked.penalties.output_counts[slot].nonzero().flatten().tolist() == sorted(set(row.output))
        assert _seen_token_ids(tracked, row.req_id) == row.output
    released_slot = tracked.requests["r5"].slot
    tracked.release(["r5"])
    assert "r5" not in tracked.requests
    newcomer = Row("new", SamplingParams(frequency_penalty=1.0), [1], [])
    tracked.add([newcomer.tracked_request])
    # Free slots are taken last-released first: the newcomer gets r5's slot, empty.
    assert tracked.requests["new"].slot == released_slot
    assert not tracked.penalties.output_counts[released_slot].any()
    assert _seen_token_ids(tracked, "new") == []


# -- through the sampler -----------------------------------------------------------------------------


def test_greedy_rows_take_the_argmax_of_processed_logits_and_logprobs_stay_raw():
    rng = random.Random(17)
    rows = [random_row(rng, index) for index in range(12)]
    for row in rows:
        row.params = dataclasses.replace(row.params, temperature=0.0, logprobs=1)
    logits = random_logits(len(rows), 17)
    sampler = Sampler(0, CPU, VOCAB)
    for step in serving_steps(rows):
        sampler.begin_step(step)
    sampled = sampler.sample(logits.clone(), [row.spec for row in rows])
    expected = processed(logits, rows).argmax(-1).tolist()
    assert [token.token_id for token in sampled] == expected
    raw_logprobs = torch.log_softmax(logits, dim=-1)
    assert [token.logprob for token in sampled] == [raw_logprobs[i, t].item() for i, t in enumerate(expected)]


def test_a_forcing_bias_and_a_ban_decide_sampled_rows_too():
    specs = [
        SampleSpec(SamplingParams(temperature=1.0, seed=seed, logit_bias={42: 100.0}), 0, f"f{seed}")
        for seed in range(50)
    ]
    tokens = [token.token_id for token in Sampler(0, CPU, VOCAB).sample(random_logits(50, 18), specs)]
    assert tokens == [42] * 50


MIN_P_FILTERS = [
    (-1, 1.0, 0.05),
    (-1, 0.9, 0.2),
    (40, 1.0, 0.1),
    (5, 0.8, 0.3),
    (-1, 1.0, 0.0),
    (3, 0.5, 1.0),
]


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_batched_min_p_equals_the_per_row_reference(temperature):
    logits = random_logits(len(MIN_P_FILTERS), 19)
    widths = [candidate_width(k, p, VOCAB) for k, p, _ in MIN_P_FILTERS]
    for width in set(widths):
        rows = [row for row, row_width in enumerate(widths) if row_width == width]
        filters = [MIN_P_FILTERS[row] for row in rows]
        nucleus = find_nucleus(
            logits[rows],
            torch.full((len(rows), 1), temperature),
            torch.tensor([[k if 0 < k < VOCAB else VOCAB] for k, _, _ in filters]),
            torch.tensor([[p] for _, p, _ in filters]),
            width,
            torch.tensor([[math.log(m) if m > 0 else -math.inf] for _, _, m in filters]),
        )
        for position, row in enumerate(rows):
            reference = filter_logits(logits[row] / temperature, *MIN_P_FILTERS[row])
            if nucleus.token_ids is None:  # every token in vocabulary order, those filtered out at 0
                assert torch.equal(nucleus.cumulative[position], reference.softmax(-1).cumsum(-1))
                continue
            kept = nucleus.token_ids[position, : int(nucleus.num_kept[position])].tolist()
            assert sorted(kept) == torch.isfinite(reference).nonzero().flatten().tolist(), MIN_P_FILTERS[row]


@pytest.mark.parametrize("top_k,top_p", [(-1, 1.0), (20, 1.0), (-1, 0.9)])
def test_min_p_draws_follow_the_filtered_softmax(top_k, top_p):
    num_draws, vocab_size, temperature, min_p = 20000, 40, 0.8, 0.15
    logits = torch.randn(vocab_size, generator=torch.Generator().manual_seed(20)) * 1.5
    params = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    specs = [
        SampleSpec(SamplingParams(seed=draw // 100, **params), draw % 100, "r") for draw in range(num_draws)
    ]
    tokens = [t.token_id for t in Sampler(0, CPU, vocab_size).sample(logits.expand(num_draws, -1), specs)]
    probs = filter_logits(logits / temperature, top_k, top_p, min_p).softmax(-1)
    assert_follows(tokens, probs)
    without_min_p = filter_logits(logits / temperature, top_k, top_p).softmax(-1)
    assert chi_square_p_value(tokens, without_min_p) < 1e-6
