"""Server-sent events stay one line per event whatever the text: clients that split lines as
Python's str.splitlines does (httpx's iter_lines) must not get a generated event in pieces."""

from __future__ import annotations

import json

import pytest

from firsttoken.server import sse

# Every character str.splitlines breaks at, and text around them.
LINE_BREAKS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"


@pytest.mark.parametrize("character", list(LINE_BREAKS), ids=[f"U+{ord(c):04X}" for c in LINE_BREAKS])
def test_an_event_is_one_line_whatever_characters_its_text_holds(character):
    text = f"before{character}after"
    encoded = sse.event({"choices": [{"text": text, "index": 0}]}).decode()
    lines = encoded.splitlines()
    assert lines[1:] == [""]  # the event's one line, then the blank line that ends it
    assert lines[0].startswith("data: ")
    assert json.loads(lines[0].removeprefix("data: "))["choices"][0]["text"] == text


def test_other_text_is_sent_as_utf8_unescaped():
    encoded = sse.event({"text": "café — 東京 \U0001f600"})
    assert "café — 東京 \U0001f600".encode() in encoded
