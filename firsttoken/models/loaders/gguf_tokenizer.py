"""Builds a `tokenizers` Tokenizer from the `tokenizer.ggml.*` metadata of a GGUF file.

Two vocabularies exist in GGUF files of Llama-family models: "gpt2" (byte-level BPE with
merges: Llama 3, Qwen2, SmolLM) and "llama" (SentencePiece BPE with scores and byte
fallback: Llama 2, Mistral). The pre-tokenizer of a byte-level vocabulary is chosen by
`tokenizer.ggml.pre` exactly as llama.cpp chooses its regexes.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from tokenizers import processors

GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp's pre-tokenizer families: digits split one by one, then the GPT-2 regex.
_DIGIT_SPLIT_PRE = {"starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva"}
_LLAMA3_PRE = {"llama3", "llama-bpe", "llama-v3", "falcon3", "pixtral"}
_QWEN2_PRE = {"qwen2", "stablelm2", "deepseek-r1-qwen", "megrez"}

TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
TOKEN_TYPE_BYTE = 6


@dataclass(frozen=True)
class GGUFVocab:
    """The tokenizer fields of a GGUF file, as plain Python values."""

    model: str
    pre: str | None
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    scores: list[float]
    bos_token_id: int | None
    add_bos_token: bool


def build_tokenizer(vocab: GGUFVocab) -> Tokenizer:
    if vocab.model == "gpt2":
        tokenizer = _byte_level_bpe(vocab)
    elif vocab.model == "llama":
        tokenizer = _sentencepiece_bpe(vocab)
    else:
        raise ValueError(
            f"tokenizer.ggml.model: vocabulary type {vocab.model!r} is not supported (gpt2, llama)"
        )
    _add_special_tokens(tokenizer, vocab)
    if vocab.add_bos_token and vocab.bos_token_id is not None:
        bos = vocab.tokens[vocab.bos_token_id]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0",
            pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
            special_tokens=[(bos, vocab.bos_token_id)],
        )
    return tokenizer


def _byte_level_bpe(vocab: GGUFVocab) -> Tokenizer:
    token_to_id = {token: index for index, token in enumerate(vocab.tokens)}
    merges = [tuple(merge.split(" ", 1)) for merge in vocab.merges]
    tokenizer = Tokenizer(
        models.BPE(vocab=token_to_id, merges=merges, fuse_unk=False, byte_fallback=False)
    )
    tokenizer.pre_tokenizer = _byte_level_pre_tokenizer(vocab.pre)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _byte_level_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    if pre in _LLAMA3_PRE or pre in _QWEN2_PRE:
        pattern = LLAMA3_PATTERN if pre in _LLAMA3_PRE else QWEN2_PATTERN
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGIT_SPLIT_PRE:
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    return byte_level


def _sentencepiece_bpe(vocab: GGUFVocab) -> Tokenizer:
    token_to_id = {token: index for index, token in enumerate(vocab.tokens)}
    unk_ids = [i for i, kind in enumerate(vocab.token_types) if kind == TOKEN_TYPE_UNKNOWN]
    unk_token = vocab.tokens[unk_ids[0]] if unk_ids else None
    tokenizer = Tokenizer(
        models.BPE(
            vocab=token_to_id,
            merges=_merges_from_scores(vocab),
            unk_token=unk_token,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    tokenizer.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(content=" ", left=1, right=0),
        ]
    )
    return tokenizer


def _merges_from_scores(vocab: GGUFVocab) -> list[tuple[str, str]]:
    """SentencePiece BPE has no merge list: every split of a normal token into two known
    pieces is a merge, ranked by the merged token's score (higher merges first)."""
    token_to_id = {token: index for index, token in enumerate(vocab.tokens)}
    ranked: list[tuple[float, int, int, tuple[str, str]]] = []
    for token, token_id in token_to_id.items():
        if vocab.token_types[token_id] != TOKEN_TYPE_NORMAL or len(token) < 2:
            continue
        for split in range(1, len(token)):
            left, right = token[:split], token[split:]
            if left in token_to_id and right in token_to_id:
                ranked.append(
                    (-vocab.scores[token_id], token_to_id[left], token_to_id[right], (left, right))
                )
    ranked.sort()
    return [pair for *_, pair in ranked]


def _add_special_tokens(tokenizer: Tokenizer, vocab: GGUFVocab) -> None:
    special, user_defined = [], []
    for token, kind in zip(vocab.tokens, vocab.token_types):
        if kind in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN):
            special.append(AddedToken(token, special=True, normalized=False))
        elif kind == TOKEN_TYPE_USER_DEFINED:
            user_defined.append(AddedToken(token, special=False, normalized=False))
    if special:
        tokenizer.add_special_tokens(special)
    if user_defined:
        tokenizer.add_tokens(user_defined)
