"""Structured output through the engine with the embedded model: every output of a random JSON
schema parses and validates against it (jsonschema), and so do JSON objects, regular
expressions, choices and grammars; the output ends where the grammar does; a bad constraint is
refused naming its field with nothing left queued; the grammar state is freed when a request
ends."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from firsttoken import LLM, SamplingParams
from firsttoken.errors import InvalidInputError
from firsttoken.sampling_params import StructuredOutput
from tests.engine_state import tracked_requests
from tests.json_schemas import example_instance, random_schema

NUM_SCHEMAS = 10
NUM_SCHEMAS_SLOW = 50
# Enough for every bounded schema here when the model copies the example's shape.
MAX_TOKENS = 120


def _chat_prompt(llm: LLM, content: str) -> str:
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": content}])


def _assert_schema_outputs_validate(llm: LLM, seeds: range) -> None:
    """One generate call over every schema (they share the steps); each output must end by its
    grammar (finish_reason stop), parse and validate."""
    schemas = [random_schema(seed) for seed in seeds]
    prompts = [
        _chat_prompt(llm, "Reply with a JSON object like " + json.dumps(example_instance(schema, seed)))
        for seed, schema in zip(seeds, schemas)
    ]
    params = [
        SamplingParams(
            temperature=0,
            max_tokens=MAX_TOKENS,
            structured_output=StructuredOutput(json_schema=json.dumps(schema)),
        )
        for schema in schemas
    ]
    for schema, output in zip(schemas, llm.generate(prompts, params)):
        assert output.finish_reason == "stop", (schema, output.text)
        jsonschema.validate(json.loads(output.text), schema)
    assert tracked_requests(llm) == {}


def test_random_schema_outputs_validate(llm):
    _assert_schema_outputs_validate(llm, range(NUM_SCHEMAS))


@pytest.mark.slow
def test_fifty_random_schema_outputs_validate(llm):
    _assert_schema_outputs_validate(llm, range(NUM_SCHEMAS_SLOW))


def test_json_object_regex_choice_and_grammars(llm):
    """Sampled (seeded) and greedy rows, side by side in one batch."""
    cases = [
        (StructuredOutput(json_object=True), "Describe Paris as a JSON object.", None),
        (StructuredOutput(regex=r"[0-9]{4}-[0-9]{2}-[0-9]{2}"), "When did the war end? Give a date.", None),
        (StructuredOutput(choice=("yes", "no", "maybe")), "Is the sky blue?", None),
        (
            StructuredOutput(grammar='root ::= "The answer is " [0-9]+ "."'),
            "What is 2 + 2?",
            re.compile(r"The answer is [0-9]+\."),
        ),
        (
            StructuredOutput(grammar='start: "color: " COLOR\nCOLOR: "red" | "green" | "blue"'),
            "Name a color.",
            re.compile(r"color: (red|green|blue)"),
        ),
    ]
    prompts = [_chat_prompt(llm, question) for _, question, _ in cases] * 2
    params = [
        SamplingParams(temperature=temperature, seed=7, max_tokens=60, structured_output=structured)
        for temperature in (0.0, 0.8)
        for structured, _, _ in cases
    ]
    outputs = llm.generate(prompts, params)
    for output, (structured, _, pattern) in zip(outputs, cases * 2):
        if structured.json_object:
            if output.finish_reason == "stop":
                assert isinstance(json.loads(output.text), dict)
            else:  # a JSON object may be longer than max_tokens: then it is a prefix of one
                assert output.text.startswith("{")
            continue
        assert output.finish_reason == "stop", output.text
        if structured.regex is not None:
            assert re.fullmatch(structured.regex, output.text), output.text
        elif structured.choice is not None:
            assert output.text in structured.choice
        else:
            assert pattern.fullmatch(output.text), output.text


def test_greedy_output_is_the_same_alone_and_in_a_batch(llm):
    structured = StructuredOutput(json_schema=json.dumps(random_schema(3)))
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_output=structured)
    prompt = _chat_prompt(
        llm, "Reply with a JSON object like " + json.dumps(example_instance(random_schema(3), 3))
    )
    alone = llm.generate([prompt], params)[0]
    batch = llm.generate(
        [prompt, "Hello", prompt], [params, SamplingParams(temperature=0, max_tokens=20), params]
    )
    assert batch[0].token_ids == alone.token_ids == batch[2].token_ids


@pytest.mark.parametrize(
    "structured",
    [
        StructuredOutput(json_schema='{"type": "object", "properties": 3}', field="response_format"),
        StructuredOutput(regex="(unclosed", field="guided_regex"),
        StructuredOutput(grammar="root ::= missing_rule", field="guided_grammar"),
    ],
)
def test_bad_constraints_are_refused_with_nothing_queued(llm, structured):
    good = SamplingParams(max_tokens=4, structured_output=StructuredOutput(regex="[a-z]+"))
    bad = SamplingParams(max_tokens=4, structured_output=structured)
    with pytest.raises(InvalidInputError) as raised:
        llm.generate(["one", "two"], [good, bad])
    assert raised.value.field == structured.field
    assert not llm.core.has_unfinished_requests()
    assert tracked_requests(llm) == {}


def test_an_aborted_request_frees_its_grammar(llm):
    params = SamplingParams(
        temperature=0, max_tokens=50, structured_output=StructuredOutput(json_object=True)
    )
    stream = llm.stream("Describe a cat as JSON:", params)
    next(stream)
    assert len(tracked_requests(llm)) == 1
    stream.close()
    assert tracked_requests(llm) == {}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_past_the_grammars_end_only_end_of_sequence_is_drawn(llm, temperature):
    """With ignore_eos the request goes on after its grammar ended: it draws end-of-sequence
    (never a token from nothing), and its text is the grammar's."""
    params = SamplingParams(
        temperature=temperature, seed=1, max_tokens=6, ignore_eos=True,
        structured_output=StructuredOutput(choice=("yes", "no")),
    )
    output = llm.generate(["Pick one:"], params)[0]
    assert output.finish_reason == "length" and output.text in ("yes", "no")
    assert set(output.token_ids[-3:]) <= llm.tokenizer.eos_token_ids


def test_min_tokens_is_refused_with_structured_output():
    with pytest.raises(InvalidInputError) as raised:
        SamplingParams(min_tokens=2, structured_output=StructuredOutput(json_object=True))
    assert raised.value.field == "min_tokens"
