"""The Hermes tool-call format without a server: parsing whole and streamed outputs (split
anywhere, the same calls and text), held-back tag prefixes, malformed, unclosed and cut-off calls
dropped, never shown as text; the conversation rewritten for a template without tools; the
forcing grammar accepts a call that follows a tool's schema and nothing else."""

from __future__ import annotations

import json

import pytest

from firsttoken.sample.grammar import GrammarCompiler
from firsttoken.server.tool_calls import (
    ToolCallParser,
    forcing_constraint,
    hermes_conversation,
    parse_tool_calls,
    tools_system_prompt,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
OUTPUT = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)


def test_whole_output_parses_into_text_and_calls():
    content, calls = parse_tool_calls(OUTPUT)
    assert content == "Let me check."
    assert [(call.name, json.loads(call.arguments)) for call in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {})
    ]
    assert len({call.id for call in calls}) == 2


@pytest.mark.parametrize("piece_len", [1, 2, 3, 7, 11])
def test_streamed_output_split_anywhere_gives_the_same_calls(piece_len):
    parser = ToolCallParser()
    text, calls = "", []
    for start in range(0, len(OUTPUT), piece_len):
        piece_text, piece_calls = parser.feed(OUTPUT[start : start + piece_len])
        assert "<" not in piece_text, "a tag's start leaked out as text"
        text += piece_text
        calls += piece_calls
    rest, last_calls = parser.finish()
    assert last_calls == []
    text += rest
    assert text == "Let me check.\n"
    assert [call.name for call in calls] == ["get_weather", "get_time"]
    assert parser.num_calls == 2


def test_text_that_only_looks_like_a_tag_is_released():
    parser = ToolCallParser()
    assert parser.feed("a <tool") == ("a ", [])
    assert parser.feed("s> b") == ("<tools> b", [])
    assert parser.finish() == ("", [])


def test_malformed_and_unfinished_calls_are_dropped_not_shown():
    assert parse_tool_calls("Sure.<tool_call>\nnot json\n</tool_call>\nDone.") == ("Sure.Done.", [])
    assert parse_tool_calls('Sure. <tool_call>\n{"name": "f"') == ("Sure.", [])


@pytest.mark.parametrize("piece_len", [1, 4, 100])
def test_a_whole_call_the_model_ends_without_its_end_tag_counts(piece_len):
    """As vLLM's Hermes parser takes it: the body is a whole call, only the tag is missing."""
    output = 'Sure. <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n'
    content, (call,) = parse_tool_calls(output)
    assert content == "Sure." and call.name == "f" and json.loads(call.arguments) == {"a": 1}
    parser = ToolCallParser(parallel=False)
    pieces = range(0, len(output), piece_len)
    shown = "".join(parser.feed(output[start : start + piece_len])[0] for start in pieces)
    rest, (streamed,) = parser.finish()
    assert (shown + rest).strip() == "Sure." and streamed.name == "f" and parser.num_calls == 1


# A named call at temperature 1, cut by max_tokens 40: the end tag inside the argument's string.
CUT_INSIDE_A_STRING = '<tool_call>\n{"name": "get_weather", "arguments": {"city": ")[1]};</tool_call>\n, \\"x'


@pytest.mark.parametrize("piece_len", [1, 5, len(CUT_INSIDE_A_STRING)])
def test_an_end_tag_inside_a_json_string_does_not_end_the_call(piece_len):
    for cut_off in (True, False):
        assert parse_tool_calls(CUT_INSIDE_A_STRING, parallel=False, cut_off=cut_off) == (None, [])
        parser = ToolCallParser(parallel=False)
        pieces = range(0, len(CUT_INSIDE_A_STRING), piece_len)
        shown = "".join(parser.feed(CUT_INSIDE_A_STRING[start : start + piece_len])[0] for start in pieces)
        assert (shown, *parser.finish(cut_off=cut_off)) == ("", "", [])
    whole = '<tool_call>\n{"name": "f", "arguments": {"a": "x</tool_call>\\"y"}}\n</tool_call>'
    content, (call,) = parse_tool_calls(whole)
    assert content is None and json.loads(call.arguments) == {"a": 'x</tool_call>"y'}


def test_conversation_for_a_template_without_tools():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "a",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                },
                {
                    "id": "b",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "a", "content": "sunny"},
        {"role": "tool", "tool_call_id": "b", "content": "rainy"},
    ]
    assert hermes_conversation(messages, [WEATHER]) == [
        {"role": "system", "content": "Be brief.\n\n" + tools_system_prompt([WEATHER])},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": (
                '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
                '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
            ),
        },
        {
            "role": "user",
            "content": "<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrainy\n</tool_response>",
        },
    ]
    assert json.dumps(WEATHER) in tools_system_prompt([WEATHER])


@pytest.fixture(scope="module")
def compiler(embedded_tokenizer):
    tokenizer = embedded_tokenizer
    return tokenizer, GrammarCompiler(tokenizer, tokenizer.vocab_size)


def _accepts(compiler, constraint, text: str) -> bool:
    tokenizer, grammar_compiler = compiler
    matcher = grammar_compiler.compile(constraint).new_state().matcher
    return matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False)) and matcher.is_accepting()


def test_forcing_grammars(compiler):
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    time_call = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    required = forcing_constraint([WEATHER, TIME], None)
    assert _accepts(compiler, required, call)
    assert _accepts(compiler, required, call + "\n" + time_call)
    assert not _accepts(compiler, required, "Sure! " + call)
    assert not _accepts(compiler, required, call.replace('"city"', '"town"'))
    named = forcing_constraint([WEATHER, TIME], "get_time")
    assert _accepts(compiler, named, time_call)
    assert not _accepts(compiler, named, call)
    assert not _accepts(compiler, named, time_call + "\n" + time_call)


def test_required_without_parallel_tool_calls_forces_exactly_one_call(compiler):
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    time_call = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    one = forcing_constraint([WEATHER, TIME], None, parallel=False)
    assert _accepts(compiler, one, call) and _accepts(compiler, one, time_call)
    assert not _accepts(compiler, one, call + "\n" + time_call)


def test_forced_call_closes_objects_whose_schema_does_not_say():
    open_city = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "where": {"type": "object"}}}}}
    grammar = forcing_constraint([open_city], "get_weather").grammar
    schema = json.loads(grammar.split("%json ")[1].split(' "\\n')[0])
    arguments = schema["anyOf"][0]["properties"]["arguments"]
    assert arguments["additionalProperties"] is False
    assert arguments["properties"]["where"]["additionalProperties"] is False
    assert "additionalProperties" not in open_city["function"]["parameters"], "the request's tool stays"


def test_forced_call_grammar_refuses_extra_keys_unless_the_schema_allows_them(compiler):
    def tool(parameters: dict) -> dict:
        return {"type": "function", "function": {"name": "get_weather", "parameters": parameters}}

    city = {"type": "object", "properties": {"city": {"type": "string"}}}
    extra = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "x": 1}}\n</tool_call>'
    plain = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    closed = forcing_constraint([tool(city)], "get_weather")
    assert _accepts(compiler, closed, plain) and not _accepts(compiler, closed, extra)
    allowing = forcing_constraint([tool({**city, "additionalProperties": True})], "get_weather")
    assert _accepts(compiler, allowing, extra)


def test_without_parallel_tool_calls_only_the_first_call_counts():
    content, calls = parse_tool_calls(OUTPUT, parallel=False)
    assert content == "Let me check." and [call.name for call in calls] == ["get_weather"]
    parser = ToolCallParser(parallel=False)
    streamed = [call.name for piece in (OUTPUT[:70], OUTPUT[70:]) for call in parser.feed(piece)[1]]
    assert streamed == ["get_weather"] and parser.num_calls == 1


def test_a_call_cut_off_by_max_tokens_is_dropped_not_shown():
    cut = 'Sure. <tool_call>\n{"name": "get_weather", "argu'
    assert parse_tool_calls(cut, cut_off=True) == ("Sure.", [])
    parser = ToolCallParser()
    assert parser.feed(cut) == ("Sure. ", [])
    assert parser.finish(cut_off=True) == ("", [])
    held = ToolCallParser()
    assert held.feed("Sure. <tool_") == ("Sure. ", [])
    assert held.finish(cut_off=True) == ("", [])
