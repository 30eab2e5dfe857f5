"""Tokenizer: text <-> token ids, the end-of-sequence ids and the chat template of one model."""

from __future__ import annotations

import datetime
import functools
import json
import os
import re
from typing import Any, Callable, Sequence

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.parser
import jinja2.sandbox
import jinja2.utils
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders

from firsttoken.errors import InvalidInputError


def _raise_template_exception(message: str) -> None:
    raise InvalidInputError("messages", message)


def _strftime_now(format_string: str) -> str:
    return datetime.datetime.now().strftime(format_string)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """transformers' tojson: plain json.dumps, where Jinja's own escapes <, >, & and ' for HTML."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`, which transformers' templates use to mark the
    assistant's tokens for training masks: rendered as its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _render_body(caller: Callable[[], str]) -> str:
        return caller()


class _TemplateNamespace(jinja2.utils.Namespace):
    """transformers' namespace(): no underscore-prefixed attributes (a sandbox escape route)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # Jinja's signature trick: `self` may be a key
        self, args = args[0], args[1:]
        attributes = dict(*args, **kwargs)
        for name in attributes:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attributes)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set {name!r} on a namespace")


# What the template gets from render()'s own arguments; chat_template_kwargs may not set them.
RESERVED_TEMPLATE_NAMES = frozenset({"messages", "tools", "documents", "add_generation_prompt"})


class ChatTemplate:
    """A model's Jinja chat template, rendered in a sandbox as transformers renders it: its
    environment (trim_blocks, lstrip_blocks, loop controls, the generation tag, tojson without
    HTML escaping, raise_exception, strftime_now, namespace) and its variables (messages, tools,
    documents, add_generation_prompt, the special tokens, and extra keyword arguments)."""

    def __init__(self, source: str, bos_token: str, eos_token: str) -> None:
        environment = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, "jinja2.ext.loopcontrols"]
        )
        environment.filters["tojson"] = _tojson
        environment.globals["raise_exception"] = _raise_template_exception
        environment.globals["strftime_now"] = _strftime_now
        environment.globals["namespace"] = _TemplateNamespace
        self.source = source
        self._template = environment.from_string(source)
        # Whether the template renders a `tools` variable (else tools need writing into messages).
        self.renders_tools = "tools" in jinja2.meta.find_undeclared_variables(environment.parse(source))
        self._bos_token = bos_token
        self._eos_token = eos_token

    def render(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        *,
        tools: Sequence[dict[str, Any]] | None = None,
        documents: Sequence[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """`template_kwargs` (a request's chat_template_kwargs) may override the special tokens,
        as in transformers, but not the arguments above."""
        reserved = RESERVED_TEMPLATE_NAMES.intersection(template_kwargs or {})
        if reserved:
            raise InvalidInputError("chat_template_kwargs", f"may not set {sorted(reserved)}")
        variables = {"bos_token": self._bos_token, "eos_token": self._eos_token, **(template_kwargs or {})}
        return self._template.render(
            messages=list(messages),
            tools=None if tools is None else list(tools),
            documents=None if documents is None else list(documents),
            add_generation_prompt=add_generation_prompt,
            **variables,
        )


def read_tokenizer_file(path: str) -> RustTokenizer:
    """The `tokenizers` Tokenizer of a tokenizer.json, parsed once per version of the file in this
    process: engines of one model share it (parsing a 49152-token vocabulary takes ~0.2 s), and
    nothing changes a backend after loading."""
    status = os.stat(path)
    return _parsed_tokenizer_file(os.path.realpath(path), status.st_size, status.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _parsed_tokenizer_file(real_path: str, size: int, modified_ns: int) -> RustTokenizer:
    return RustTokenizer.from_file(real_path)


class Tokenizer:
    """Wraps a `tokenizers` Tokenizer; read-only after construction, so safe across threads."""

    def __init__(
        self,
        backend: RustTokenizer,
        eos_token_ids: Sequence[int],
        bos_token_id: int | None,
        chat_template: str | None,
    ) -> None:
        self.backend = backend
        self.eos_token_ids = frozenset(eos_token_ids)
        self.bos_token_id = bos_token_id
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        bos_text = backend.id_to_token(bos_token_id) if bos_token_id is not None else ""
        eos_text = backend.id_to_token(min(eos_token_ids)) if eos_token_ids else ""
        self.chat_template = (
            ChatTemplate(chat_template, bos_text or "", eos_text or "") if chat_template else None
        )
        self._added_token_ids = frozenset(backend.get_added_tokens_decoder())
        self._is_byte_level = isinstance(backend.decoder, decoders.ByteLevel)

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled as what built it (the compiled chat template is not picklable), so that a
        router in another process tokenizes exactly as the engine does."""
        chat_template = self.chat_template.source if self.chat_template is not None else None
        return Tokenizer, (self.backend, sorted(self.eos_token_ids), self.bos_token_id, chat_template)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # `encode_batch` releases the GIL while it works and `encode` does not: a long prompt
        # encoded on a worker thread must not stall the server's event loop.
        (encoding,) = self.backend.encode_batch([text], add_special_tokens=add_special_tokens)
        return encoding.ids

    def encode_bad_words(self, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
        """Each word's token ids as it starts a text and, where that differs, as it follows a
        space (a different first token, the same count): vLLM's tokenization of bad words, so
        a word is banned at the start of the output and inside it."""
        sequences: list[tuple[int, ...]] = []
        for word in words:
            at_start = tuple(self.encode(word.lstrip(), add_special_tokens=False))
            sequences.append(at_start)
            after_space = tuple(self.encode(" " + word.lstrip(), add_special_tokens=False))
            if after_space[0] != at_start[0] and len(after_space) == len(at_start):
                sequences.append(after_space)
        return tuple(sequences)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for. A token may hold part of a UTF-8 character, which
        decoding it alone turns into U+FFFD; its bytes are exact. Raises InvalidInputError for
        an id outside the vocabulary."""
        piece = self.backend.id_to_token(token_id)
        if piece is None:
            raise InvalidInputError("token_id", f"{token_id} is not in the vocabulary")
        if token_id in self._added_token_ids:
            return piece.encode("utf-8")
        if self._is_byte_level:
            return bytes(_BYTE_LEVEL_BYTES[char] for char in piece)
        byte_fallback = _BYTE_FALLBACK_PIECE.fullmatch(piece)
        if byte_fallback:
            return bytes([int(byte_fallback.group(1), 16)])
        return piece.replace("\u2581", " ").encode("utf-8")  # SentencePiece's word-start mark

    def longest_token_bytes(self) -> int:
        """The most bytes any one token stands for: a text of n bytes is at least n / this tokens."""
        return max(len(self.token_bytes(token_id)) for token_id in self.backend.get_vocab().values())

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        *,
        tools: Sequence[dict[str, Any]] | None = None,
        documents: Sequence[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        if self.chat_template is None:
            raise InvalidInputError("messages", "this model has no chat template; send a plain prompt")
        _validate_messages(messages)
        return self.chat_template.render(
            messages, add_generation_prompt, tools=tools, documents=documents, template_kwargs=template_kwargs
        )


CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")

_BYTE_FALLBACK_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, character -> byte: printable bytes stand for themselves,
    the others (controls, space, some Latin-1) for the characters from U+0100 on, in order."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\N{INVERTED EXCLAMATION MARK}"), ord("\N{NOT SIGN}") + 1),
        *range(ord("\N{REGISTERED SIGN}"), ord("\N{LATIN SMALL LETTER Y WITH DIAERESIS}") + 1),
    ]
    alphabet = {chr(byte): byte for byte in printable}
    shifted = (byte for byte in range(256) if byte not in alphabet.values())
    for offset, byte in enumerate(shifted):
        alphabet[chr(256 + offset)] = byte
    return alphabet


_BYTE_LEVEL_BYTES = _byte_level_alphabet()


def _validate_messages(messages: Sequence[dict[str, Any]]) -> None:
    if not messages:
        raise InvalidInputError("messages", "must hold at least one message")
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidInputError(f"messages[{index}]", "must be an object with role and content")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise InvalidInputError(f"messages[{index}].role", f"must be one of {CHAT_ROLES}, got {role!r}")
        content = message.get("content")
        # An assistant's message that only calls tools has no content.
        if not isinstance(content, str) and not (
            content is None and role == "assistant" and message.get("tool_calls")
        ):
            raise InvalidInputError(f"messages[{index}].content", "must be a string")
