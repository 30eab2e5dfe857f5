"""Incremental detokenization and stop strings for one request's output stream."""

from __future__ import annotations

from firsttoken.tokenizer import Tokenizer

# Prompt tokens decoded as left context, so that tokenizers which strip a leading space
# (SentencePiece) or merge bytes across tokens still produce the right first characters.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns output tokens into text as they arrive; never emits half a UTF-8 character."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.tokens = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.text = ""

    def add_token(self, token_id: int) -> str:
        """Append a token; returns the text it completes (may be empty)."""
        self.tokens.append(token_id)
        prefix_text = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.tokens[self.prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""
        new_text = full_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.tokens)
        self.text += new_text
        return new_text

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)


class StopStringMatcher:
    """Finds the first stop string in a growing text and holds back what could start one."""

    def __init__(self, stop: tuple[str, ...], include_stop_str: bool) -> None:
        self.stop = stop
        self.include_stop_str = include_stop_str
        self.hold_back = max((len(s) for s in stop), default=1) - 1

    def find(self, text: str, num_new_chars: int) -> tuple[str, int] | None:
        """(stop string, index where the kept text ends) if a stop string appears in the
        last `num_new_chars` characters (or straddles them), else None."""
        if not self.stop or num_new_chars == 0:
            return None
        search_from = max(0, len(text) - num_new_chars - self.hold_back)
        best: tuple[int, str] | None = None
        for stop_string in self.stop:
            index = text.find(stop_string, search_from)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop_string)
        if best is None:
            return None
        index, stop_string = best
        end = index + len(stop_string) if self.include_stop_str else index
        return stop_string, end
