"""Up-front checks: unknown fields (named in one warning per request, or refused when strict) and
prompt bytes."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from firsttoken.engine import InvalidInputError
from firsttoken.server.protocol import CompletionRequest
from firsttoken.server.request_checks import RequestChecks


def _checks(strict_fields: bool) -> RequestChecks:
    tokenizer = SimpleNamespace(longest_token_bytes=lambda: 10)
    engine = SimpleNamespace(max_request_tokens=100, max_model_len=100, tokenizer=tokenizer)
    return RequestChecks(engine, strict_fields)


def _request(**fields) -> CompletionRequest:
    return CompletionRequest.model_validate({"prompt": "hi", **fields})


def test_unknown_fields_are_named_in_one_warning_per_request(caplog):
    checks = _checks(strict_fields=False)
    with caplog.at_level(logging.DEBUG, logger="firsttoken.server.request_checks"):
        for _ in range(2):
            checks.check_fields(_request(metadata={"a": 1}, store=False, presence_penalty=0))
        checks.check_fields(_request(presence_penalty=0.5, min_p=0.1))  # defined: nothing to say
    assert [(record.levelname, record.getMessage()) for record in caplog.records] == [
        ("WARNING", "ignoring request fields the API does not define: 'metadata', 'store'")
    ] * 2


def test_a_warning_names_a_bounded_number_of_fields(caplog):
    with caplog.at_level(logging.WARNING, logger="firsttoken.server.request_checks"):
        _checks(strict_fields=False).check_fields(
            _request(**{f"field{index}" + "x" * 200: 1 for index in range(40)})
        )
    (record,) = caplog.records
    assert record.getMessage().endswith(" and 24 more") and len(record.getMessage()) < 2000


def test_strict_fields_refuse_an_unknown_field_by_name():
    with pytest.raises(InvalidInputError) as raised:
        _checks(strict_fields=True).check_fields(_request(metadata={}))
    assert raised.value.field == "metadata"
    _checks(strict_fields=True).check_fields(_request(presence_penalty=0.5, bad_words=["x"]))  # defined


def test_prompt_bytes_that_cannot_fit_are_refused_before_tokenizing():
    checks = _checks(strict_fields=False)
    checks.check_prompt_bytes("prompt", ["x" * 989])  # at least 99 tokens: one left for output
    with pytest.raises(InvalidInputError) as raised:
        checks.check_prompt_bytes("prompt[1]", ["x" * 500, "é" * 250])
    assert raised.value.field == "prompt[1]"


@pytest.mark.parametrize(
    "stop,field", [(["s"] * 17, "stop"), ("x" * 257, "stop"), (["ok", "x" * 257], "stop[1]")]
)
def test_stop_strings_are_capped_in_count_and_length(stop, field):
    with pytest.raises(ValueError) as raised:
        _request(stop=stop)
    assert f"{field}:" in str(raised.value)
