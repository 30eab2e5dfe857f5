"""\\d and \\w read as ASCII in regular expressions and schema patterns; \\p{..} keeps Unicode."""

from __future__ import annotations

import pytest

from firsttoken.models.registry import default_model_path, open_checkpoint
from firsttoken.sample.ascii_classes import ascii_classes, ascii_schema_patterns
from firsttoken.sample.grammar import GrammarCompiler
from firsttoken.sampling_params import StructuredOutput


@pytest.mark.parametrize(
    "pattern,expected",
    [
        (r"\d{3}-\w+", "[0-9]{3}-[0-9A-Za-z_]+"),
        (r"[\d.]+", "[0-9.]+"),
        (r"[^\d]", "[^0-9]"),
        (r"[]\d]", "[]0-9]"),
        (r"\D\W", "[^0-9][^0-9A-Za-z_]"),
        (r"\\d", r"\\d"),  # an escaped backslash, then a letter d
        (r"\p{Nd}+", r"\p{Nd}+"),
    ],
)
def test_classes_are_spelled_as_ascii_ranges(pattern, expected):
    assert ascii_classes(pattern) == expected


def test_schema_patterns_are_rewritten_in_a_copy():
    schema = {"type": "object", "properties": {"pattern": {"type": "string", "pattern": r"^\d$"}},
              "patternProperties": {r"^\w$": {"pattern": r"\w"}}, "anyOf": [{"pattern": r"\d"}]}  # fmt: skip
    rewritten = ascii_schema_patterns(schema)
    assert rewritten["properties"]["pattern"]["pattern"] == "^[0-9]$"
    assert rewritten["patternProperties"] == {"^[0-9A-Za-z_]$": {"pattern": "[0-9A-Za-z_]"}}
    assert rewritten["anyOf"] == [{"pattern": "[0-9]"}]
    assert schema["properties"]["pattern"]["pattern"] == r"^\d$"


@pytest.fixture(scope="module")
def compiler():
    tokenizer = open_checkpoint(default_model_path()).tokenizer
    return tokenizer, GrammarCompiler(tokenizer, tokenizer.vocab_size)


def _accepts(compiler, structured: StructuredOutput, text: str) -> bool:
    tokenizer, grammar_compiler = compiler
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    matcher = grammar_compiler.compile(structured).new_state().matcher
    return matcher.try_consume_tokens(token_ids) == len(token_ids) and matcher.is_accepting()


@pytest.mark.parametrize("digits,accepted", [("123", True), ("🯸🯸🯸", False), ("٣٣", False)])
def test_guided_regex_digits_are_ascii(compiler, digits, accepted):
    assert _accepts(compiler, StructuredOutput(regex=r"\d+"), digits) is accepted


def test_unicode_digits_when_asked_for(compiler):
    assert _accepts(compiler, StructuredOutput(regex=r"\p{Nd}+"), "٣٣")


def test_schema_pattern_digits_are_ascii(compiler):
    schema = '{"type": "string", "pattern": "^\\\\d+$"}'
    assert _accepts(compiler, StructuredOutput(json_schema=schema), '"42"')
    assert not _accepts(compiler, StructuredOutput(json_schema=schema), '"🯸🯸"')
