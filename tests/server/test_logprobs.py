"""Logprobs name each token by its real bytes, and completion offsets count characters."""

from __future__ import annotations

import pytest

from firsttoken.models.registry import open_checkpoint
from firsttoken.outputs import SampledToken, TokenLogprob
from firsttoken.server.chat import _ChatReply
from firsttoken.server.completions import _CompletionReply, text_offsets
from firsttoken.server.protocol import CompletionRequest

ROCKET = "🚀"  # four UTF-8 bytes that SmolLM2's vocabulary splits over several tokens


@pytest.fixture(scope="module")
def tokenizer(model_path):
    return open_checkpoint(model_path).tokenizer


def _sampled(token_ids: list[int]) -> list[SampledToken]:
    return [SampledToken(token_id, -0.5, [TokenLogprob(token_id, -0.5)]) for token_id in token_ids]


def test_chat_logprobs_of_a_split_character_carry_its_bytes(tokenizer):
    token_ids = tokenizer.encode("go " + ROCKET, add_special_tokens=False)
    content = _ChatReply("m", tokenizer, parses_tool_calls=False)._logprobs(_sampled(token_ids)).content
    assert bytes(byte for entry in content for byte in entry.bytes) == ("go " + ROCKET).encode()
    assert all("\ufffd" not in entry.token for entry in content)
    assert any(entry.token.startswith("\\x") for entry in content), "a partial character shows its bytes"
    assert [top.bytes for entry in content for top in entry.top_logprobs] == [e.bytes for e in content]


def test_completion_text_offsets_count_characters_from_the_prompt_start(tokenizer):
    text = "go " + ROCKET + " now"
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    prompt_length = len("Say: ")
    reply = _CompletionReply("m", tokenizer, ["Say: "], CompletionRequest(prompt="Say: ", logprobs=1))
    logprobs = reply._logprobs(_sampled(token_ids), prompt_length)
    pieces = [tokenizer.token_bytes(token_id) for token_id in token_ids]
    expected = []
    consumed = b""
    for piece in pieces:
        expected.append(prompt_length + len(consumed.decode("utf-8", "ignore")))
        consumed += piece
    assert logprobs.text_offset == expected


def test_text_offsets_give_the_tokens_of_one_split_character_the_same_start():
    assert text_offsets([b"a", b"\xf0\x9f", b"\x9a\x80", b"b"], 10) == [10, 11, 11, 12]
