"""Errors to OpenAI error bodies: the field a typed error names becomes `param`, no message is parsed."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import models

from firsttoken.engine import InvalidInputError, Tokenizer
from firsttoken.sampling_params import SamplingParams
from firsttoken.server.errors import from_exception

RETRY_AFTER_S = 1


def _raised_by(action) -> Exception:
    with pytest.raises(ValueError) as raised:
        action()
    return raised.value


def test_an_invalid_input_error_is_a_400_whose_param_is_its_field():
    error = from_exception(InvalidInputError("messages[2].content", "must be a string"), RETRY_AFTER_S)
    assert (error.status_code, error.param) == (400, "messages[2].content")
    assert error.message == "messages[2].content: must be a string"


def test_a_plain_value_error_is_a_400_without_param_even_when_phrased_like_a_field():
    error = from_exception(ValueError("max_tokens: too many"), RETRY_AFTER_S)
    assert (error.status_code, error.param, error.message) == (400, None, "max_tokens: too many")


def test_sampling_params_name_their_field_as_param():
    error = from_exception(_raised_by(lambda: SamplingParams(temperature=-1)), RETRY_AFTER_S)
    assert (error.status_code, error.param) == (400, "temperature")
    assert error.message == "temperature: must be >= 0, got -1"


def test_an_unknown_chat_role_names_the_message_as_param():
    tokenizer = Tokenizer(
        RustTokenizer(models.WordLevel({"a": 0}, unk_token="a")), [0], None, "{{ messages }}"
    )
    robot = [{"role": "user", "content": "hi"}, {"role": "robot", "content": "beep"}]
    error = from_exception(_raised_by(lambda: tokenizer.apply_chat_template(robot)), RETRY_AFTER_S)
    assert (error.status_code, error.param) == (400, "messages[1].role")
    assert error.message.startswith("messages[1].role: must be one of")
