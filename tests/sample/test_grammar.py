"""Structured output in the sampler: a constrained row's masked logits equal a plain reference
(the allowed set worked out from the tokens' bytes, every other logit -inf, then greedy), rows
without a constraint are untouched, the matcher follows the tokens fed back as inputs, and bad
schemas, regular expressions and grammars are refused naming their field."""

from __future__ import annotations

import json
import re

import pytest
import torch

from firsttoken.core.batch import SampleSpec, ScheduledChunk, SchedulerOutput, TrackedRequest
from firsttoken.errors import InvalidInputError
from firsttoken.sample.grammar import GrammarCompiler, apply_bitmask
from firsttoken.sample.sampler import Sampler
from firsttoken.sampling_params import SamplingParams, StructuredOutput

CPU = torch.device("cpu")
COLORS = ("red", "green", "blue", "light blue")


@pytest.fixture(scope="module")
def tokenizer(embedded_tokenizer):
    return embedded_tokenizer


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, tokenizer.vocab_size)


def token_texts(tokenizer) -> list[bytes | None]:
    """Each token's bytes; None for special tokens (never part of a grammar's text)."""
    special = set(tokenizer.backend.get_added_tokens_decoder())
    return [
        None if token_id in special else tokenizer.token_bytes(token_id)
        for token_id in range(tokenizer.vocab_size)
    ]


def reference_allowed(texts: list[bytes | None], generated: bytes, full_match: re.Pattern[bytes],
                      eos_token_ids: frozenset[int]) -> set[int]:
    """The tokens whose bytes, after `generated`, keep the output a prefix of some full match
    (checked by extending with every option: the grammars here have few), and end-of-sequence
    where the output is already a full match."""
    allowed = {token_id for token_id in eos_token_ids if full_match.fullmatch(generated)}
    for token_id, text in enumerate(texts):
        if text and _is_prefix_of_a_match(generated + text, full_match):
            allowed.add(token_id)
    return allowed


def _is_prefix_of_a_match(text: bytes, full_match: re.Pattern[bytes]) -> bool:
    return any(option.startswith(text) for option in full_match.pattern.split(b"|"))


def plain_masked_greedy(logits: torch.Tensor, allowed: set[int]) -> int:
    """The reference: every token outside `allowed` to -inf, then the argmax."""
    masked = torch.full_like(logits, float("-inf"))
    index = torch.tensor(sorted(allowed))
    masked[index] = logits[index]
    return int(masked.argmax())


def constrained(structured: StructuredOutput, **params) -> SamplingParams:
    return SamplingParams(max_tokens=32, structured_output=structured, **params)


def start_step(sampler: Sampler, compiler: GrammarCompiler, rows: dict[str, SamplingParams]) -> None:
    """The step that first schedules every row's request (a one-token prompt)."""
    tracked = [
        TrackedRequest(req_id, params, [5], (2,), (), compiler.compile(params.structured_output))
        for req_id, params in rows.items()
        if params.structured_output is not None
    ]
    chunks = [ScheduledChunk(req_id, [5], 0, [], None) for req_id in rows]
    sampler.begin_step(SchedulerOutput(chunks, tracked))


def feed(sampler: Sampler, req_id: str, position: int, token_id: int) -> None:
    sampler.begin_step(SchedulerOutput([ScheduledChunk(req_id, [token_id], position, [], None)]))


def test_masked_rows_equal_the_plain_reference_and_others_are_untouched(tokenizer, compiler):
    """Greedy decoding of a choice through the sampler, token by token on random logits: each
    constrained row's token is the reference's, an unconstrained row beside it takes its plain
    argmax, and the output ends on end-of-sequence once it is one of the choices."""
    texts = token_texts(tokenizer)
    full_match = re.compile(b"|".join(option.encode() for option in COLORS))
    choice = StructuredOutput(choice=COLORS)
    rows = {
        "choice": constrained(choice, temperature=0),
        "free": SamplingParams(temperature=0, max_tokens=32),
    }
    sampler = Sampler(0, CPU, tokenizer.vocab_size)
    start_step(sampler, compiler, rows)
    generated = b""
    generator = torch.Generator().manual_seed(3)
    for step in range(12):
        logits = torch.randn(2, tokenizer.vocab_size, generator=generator) * 4
        # Tilt the draw towards the choices' pieces, so the path goes through several tokens.
        logits[0, tokenizer.encode(" blue", add_special_tokens=False)] += 2
        raw = logits.clone()
        specs = [SampleSpec(params, step, req_id) for req_id, params in rows.items()]
        choice_token, free_token = (sampled.token_id for sampled in sampler.sample(logits, specs))
        allowed = reference_allowed(texts, generated, full_match, tokenizer.eos_token_ids)
        assert choice_token == plain_masked_greedy(raw[0], allowed)
        assert free_token == int(raw[1].argmax())
        assert torch.equal(logits[1], raw[1])
        if choice_token in tokenizer.eos_token_ids:
            break
        generated += tokenizer.token_bytes(choice_token)
        feed(sampler, "choice", 1 + step, choice_token)
        feed(sampler, "free", 1 + step, free_token)
    assert full_match.fullmatch(generated), generated
    assert choice_token in tokenizer.eos_token_ids


def test_sampled_rows_draw_only_allowed_tokens(tokenizer, compiler):
    """Rows with temperature, top-k and top-p draw from the masked logits: each draw is allowed."""
    texts = token_texts(tokenizer)
    regex = StructuredOutput(regex="[0-9]{3}")
    sampler = Sampler(0, CPU, tokenizer.vocab_size)
    rows = {
        f"r{index}": constrained(regex, temperature=1.5, seed=index, top_k=top_k, top_p=top_p)
        for index, (top_k, top_p) in enumerate([(-1, 1.0), (50, 1.0), (-1, 0.9), (20, 0.5)])
    }
    start_step(sampler, compiler, rows)
    logits = torch.randn(len(rows), tokenizer.vocab_size, generator=torch.Generator().manual_seed(5))
    specs = [SampleSpec(params, 0, req_id) for req_id, params in rows.items()]
    for sampled in sampler.sample(logits, specs):
        text = texts[sampled.token_id]
        assert text and re.fullmatch(rb"[0-9]{1,3}", text), text


def test_the_matcher_follows_inputs_not_draws(tokenizer, compiler):
    """A resent chunk (a recompute) does not advance the grammar twice."""
    sampler = Sampler(0, CPU, tokenizer.vocab_size)
    rows = {"a": constrained(StructuredOutput(regex="ab|abab"), temperature=0)}
    start_step(sampler, compiler, rows)
    (token_a,) = tokenizer.encode("a", add_special_tokens=False)
    (token_b,) = tokenizer.encode("b", add_special_tokens=False)
    feed(sampler, "a", 1, token_a)
    feed(sampler, "a", 2, token_b)
    # The whole sequence again from position 0, as after a preemption.
    sampler.begin_step(SchedulerOutput([ScheduledChunk("a", [5, token_a, token_b], 0, [], None)]))
    logits = torch.zeros(1, tokenizer.vocab_size)
    logits[0, token_a] = 1.0  # "aba..." is allowed only if the matcher stands after "ab"
    (sampled,) = sampler.sample(logits, [SampleSpec(rows["a"], 2, "a")])
    assert sampled.token_id == token_a
    sampler.release(["a"])
    assert sampler.tracked.requests == {}


def test_compiled_grammars_are_cached_by_constraint(compiler):
    schema = json.dumps({"type": "object", "properties": {"x": {"type": "integer"}}})
    first = compiler.compile(StructuredOutput(json_schema=schema, field="response_format"))
    assert compiler.compile(StructuredOutput(json_schema=schema, field="guided_json")) is first
    assert compiler.compile(StructuredOutput(json_object=True)) is not first


@pytest.mark.parametrize(
    "structured",
    [
        StructuredOutput(json_schema="{not json", field="response_format"),
        StructuredOutput(json_schema='{"type": "no-such-type"}', field="guided_json"),
        StructuredOutput(regex="a(b", field="guided_regex"),
        StructuredOutput(grammar="root ::= (", field="guided_grammar"),
        StructuredOutput(grammar="start: undefined_rule", field="guided_grammar"),
    ],
)
def test_invalid_constraints_are_refused_naming_the_field(compiler, structured):
    with pytest.raises(InvalidInputError) as raised:
        compiler.compile(structured)
    assert raised.value.field == structured.field


def test_a_constraint_holds_exactly_one_form():
    with pytest.raises(InvalidInputError, match="exactly one"):
        StructuredOutput(regex="a", choice=("a",), field="guided_choice")
    with pytest.raises(InvalidInputError) as raised:
        StructuredOutput(choice=(), field="guided_choice")
    assert raised.value.field == "guided_choice"


def test_apply_bitmask_equals_a_bit_by_bit_mask():
    """Random masks over a vocabulary that is not a multiple of 32, on some rows of a batch:
    allowed logits keep their exact values, the others are -inf, other rows are untouched."""
    generator = torch.Generator().manual_seed(11)
    vocab_size, rows = 1000, [0, 2, 3]
    bitmask = torch.randint(-(2**31), 2**31 - 1, (len(rows), -(-vocab_size // 32)), dtype=torch.int32,
                            generator=generator)
    logits = torch.randn(5, vocab_size, generator=generator)
    expected = logits.clone()
    for mask_row, row in enumerate(rows):
        for token_id in range(vocab_size):
            if not (int(bitmask[mask_row, token_id // 32]) >> (token_id % 32)) & 1:
                expected[row, token_id] = float("-inf")
    apply_bitmask(logits, rows, bitmask)
    assert torch.equal(logits, expected)

