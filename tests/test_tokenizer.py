"""firsttoken's GGUF-built tokenizer against transformers' tokenizer for the same file."""

from __future__ import annotations

import copy
import random

import pytest
from tokenizers import pre_tokenizers

from firsttoken.models.registry import open_checkpoint

FIXED = [
    "Hello, world!",
    "The year 2024 had 366 days; π ≈ 3.14159.",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\r\n",
    "naïve café résumé",
    "東京は日本の首都です。",
    "Привет, как дела?",
    "مرحبا بالعالم",
    "emoji 🙂🚀 and flags 🇫🇷",
    "code: def f(x):\n    return x ** 2  # square",
    "<|im_start|>user\nHi<|im_end|>",
    "URL https://example.com/path?query=1&b=2",
    "12345678901234567890",
    "don't won't it's they're I'm we'll I'd",
    "",
    "   ",
    "a" * 300,
    "ÀÉÎÕÜ àéîõü ßœæ",
    "\u200b zero width \u200d joiner",
    "mixed 中文 and English 和 数字 123",
]


def _random_strings(count: int) -> list[str]:
    rng = random.Random(0)
    alphabet = (
        "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,;:!?'\"-_()[]{}\n\t"
        "éèàùçäöüßñ中文日本語한국어русский🙂🚀€£¥"
    )
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 80))) for _ in range(count)]


STRINGS = FIXED + _random_strings(100 - len(FIXED))


@pytest.fixture(scope="module")
def tokenizer(model_path):
    return open_checkpoint(model_path).tokenizer


@pytest.fixture(scope="module")
def reference_tokenizer(hf_tokenizer):
    """transformers' tokenizer for the GGUF file, with SmolLM2's original pre-tokenizer.

    transformers' GGUF converter gives every "gpt2" vocabulary a plain ByteLevel
    pre-tokenizer, but SmolLM2's tokenizer.json (and llama.cpp for `tokenizer.ggml.pre =
    smollm`) splits digits one by one first. The two differ only on whitespace before a
    digit (see test_whitespace_before_digits_follows_the_original_tokenizer); everything
    else (vocabulary, merges, special tokens, decoding) is transformers' own conversion.
    """
    reference = copy.deepcopy(hf_tokenizer)
    reference.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    return reference


def test_one_hundred_strings(tokenizer, reference_tokenizer):
    hf_tokenizer = reference_tokenizer
    assert len(STRINGS) == 100
    for text in STRINGS:
        expected = hf_tokenizer.encode(text, add_special_tokens=True)
        assert tokenizer.encode(text) == expected, text
        assert tokenizer.decode(expected) == hf_tokenizer.decode(expected, skip_special_tokens=True), text
        assert tokenizer.decode(expected, skip_special_tokens=False) == hf_tokenizer.decode(expected), text


def test_whitespace_before_digits_follows_the_original_tokenizer(tokenizer):
    # Original SmolLM2 / llama.cpp: "x\n 5" -> "x", "\n ", "5" (digits split off first).
    assert [tokenizer.id_to_token(i) for i in tokenizer.encode("x\n 5")] == ["x", "ĊĠ", "5"]
    assert [tokenizer.id_to_token(i) for i in tokenizer.encode("a 12")] == ["a", "Ġ", "1", "2"]


def test_chat_template_matches_transformers(tokenizer, hf_tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye?"},
    ]
    expected = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tokenizer.apply_chat_template(messages) == expected


def test_special_tokens_and_eos(tokenizer):
    assert tokenizer.eos_token_ids == frozenset({2})
    assert tokenizer.encode("<|im_end|>") == [2]


def test_token_bytes_join_to_the_text_even_where_a_token_splits_a_character(tokenizer):
    for text in STRINGS:
        token_ids = tokenizer.encode(text, add_special_tokens=False)
        assert b"".join(tokenizer.token_bytes(token_id) for token_id in token_ids) == text.encode(), text
    rocket_ids = tokenizer.encode("🚀", add_special_tokens=False)
    split = [token_id for token_id in rocket_ids if "\ufffd" in tokenizer.decode([token_id])]
    assert split and all(len(tokenizer.token_bytes(token_id)) < 4 for token_id in split)


def test_token_bytes_of_special_tokens_are_their_text(tokenizer):
    im_end = tokenizer.token_to_id("<|im_end|>")
    assert tokenizer.token_bytes(im_end) == b"<|im_end|>"
    with pytest.raises(ValueError):
        tokenizer.token_bytes(tokenizer.vocab_size + 5)


def test_a_tokenizer_file_is_parsed_once_per_version(embedded_tokenizer, tmp_path):
    from firsttoken.tokenizer import read_tokenizer_file

    path = tmp_path / "tokenizer.json"
    path.write_text(embedded_tokenizer.backend.to_str())
    first = read_tokenizer_file(str(path))
    assert read_tokenizer_file(str(path)) is first
    assert first.encode("The sky is blue.").ids == embedded_tokenizer.backend.encode("The sky is blue.").ids
    path.write_text(embedded_tokenizer.backend.to_str(pretty=True))  # another version of the file
    assert read_tokenizer_file(str(path)) is not first
