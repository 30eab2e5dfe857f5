"""Benchmark prompts built from text: random, shared-prefix and mixed-long request sets.

Prompts are text because a serving benchmark sends text and the server tokenizes it. Token
lengths are exact when a tokenizer is at hand (the engine's, or the embedded model's) and
approximate otherwise: the words come from a list of common English words, which BPE
tokenizers of the Llama family encode as about one token each.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

DatasetName = Literal["random", "shared-prefix", "mixed-long"]
DATASET_NAMES: tuple[str, ...] = ("random", "shared-prefix", "mixed-long")

_WORDS: tuple[str, ...] = tuple(
    (
        "the of and to in is that for it as with was on be by at this from have or are not but an they "
        "which one you were all we her she there would their will when who him been has more if no out so "
        "said what up its about into than them can only other new some could time these two may then do "
        "first any my now such like our over man me even most made after also did many before must through "
        "back years where much your way well down should because each just those people how too little "
        "state good very make world still own see men work long get here between both life being under "
        "never day same another know while last might us great old year off come since against go came "
        "right used take three river house water light story city music garden letter window morning"
    ).split()
)


class PromptTokenizer(Protocol):
    """The two tokenizer calls prompt building needs (firsttoken's Tokenizer has them)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class TextSource:
    """Owns a seeded word stream and turns token-length targets into prompt texts."""

    def __init__(self, tokenizer: PromptTokenizer | None, seed: int) -> None:
        self.tokenizer = tokenizer
        self.rng = random.Random(seed)
        # Special tokens the tokenizer adds to every prompt (a BOS for Llama): part of the length.
        self.num_special_tokens = len(tokenizer.encode("")) if tokenizer is not None else 0

    def words(self, num_words: int) -> str:
        return " ".join(self.rng.choice(_WORDS) for _ in range(num_words))

    def text(self, num_tokens: int) -> str:
        """A fresh text that the tokenizer encodes to `num_tokens` tokens (about that many without one)."""
        if self.tokenizer is None:
            return self.words(num_tokens)
        target = max(1, num_tokens - self.num_special_tokens)
        words = self.words(target + 8)
        token_ids = self.tokenizer.encode(words, add_special_tokens=False)
        while len(token_ids) < target:  # words that take several tokens never shorten the text
            words += " " + self.words(target - len(token_ids) + 8)
            token_ids = self.tokenizer.encode(words, add_special_tokens=False)
        return self.tokenizer.decode(token_ids[:target])

    def count(self, text: str) -> int:
        """Tokens the server will see for `text`: exact with a tokenizer, else one per word."""
        if self.tokenizer is None:
            return len(text.split())
        return len(self.tokenizer.encode(text))


@dataclass(frozen=True)
class BenchPrompt:
    """One request of a benchmark: its text, its prompt length in tokens, and tokens to generate."""

    text: str
    num_prompt_tokens: int
    max_tokens: int


@dataclass(frozen=True)
class DatasetSpec:
    """Which request set to build and its sizes, in tokens."""

    name: DatasetName = "random"
    num_prompts: int | None = None  # None: 100, or groups x prompts per group for shared-prefix
    input_len: int = 256  # prompt tokens (the part after the shared prefix for shared-prefix)
    output_len: int = 128
    range_ratio: float = 0.0  # lengths drawn uniformly from [len * (1 - r), len * (1 + r)]
    num_prefix_groups: int = 4
    prompts_per_group: int = 8
    prefix_len: int = 512
    long_fraction: float = 0.1
    long_input_len: int = 2048
    seed: int = 0

    def __post_init__(self) -> None:
        if self.name not in DATASET_NAMES:
            raise ValueError(f"dataset: must be one of {DATASET_NAMES}, got {self.name!r}")
        for field_name in (
            "input_len",
            "output_len",
            "num_prefix_groups",
            "prompts_per_group",
            "prefix_len",
            "long_input_len",
        ):
            if getattr(self, field_name) < 1:
                raise ValueError(f"{field_name}: must be >= 1, got {getattr(self, field_name)}")
        if self.num_prompts is not None and self.num_prompts < 1:
            raise ValueError(f"num_prompts: must be >= 1, got {self.num_prompts}")
        if not 0 <= self.range_ratio < 1:
            raise ValueError(f"range_ratio: must be in [0, 1), got {self.range_ratio}")
        if not 0 <= self.long_fraction <= 1:
            raise ValueError(f"long_fraction: must be in [0, 1], got {self.long_fraction}")
        group_total = self.num_prefix_groups * self.prompts_per_group
        if self.name == "shared-prefix" and self.num_prompts not in (None, group_total):
            raise ValueError(
                f"num_prompts: shared-prefix sends groups x prompts per group = {group_total} prompts, "
                f"got {self.num_prompts}; drop it or change the group sizes"
            )

    @property
    def total_prompts(self) -> int:
        if self.name == "shared-prefix":
            return self.num_prefix_groups * self.prompts_per_group
        return self.num_prompts if self.num_prompts is not None else 100


def build_prompts(spec: DatasetSpec, tokenizer: PromptTokenizer | None) -> list[BenchPrompt]:
    """The request set of `spec`, in the order it is sent; the same seed gives the same prompts."""
    source = TextSource(tokenizer, spec.seed)
    rng = random.Random(spec.seed + 1)
    if spec.name == "shared-prefix":
        texts = _shared_prefix_texts(spec, source, rng)
    elif spec.name == "mixed-long":
        texts = [
            source.text(spec.long_input_len if rng.random() < spec.long_fraction else _jittered(spec, rng))
            for _ in range(spec.total_prompts)
        ]
    else:
        texts = [source.text(_jittered(spec, rng)) for _ in range(spec.total_prompts)]
    return [BenchPrompt(text, source.count(text), spec.output_len) for text in texts]


def _jittered(spec: DatasetSpec, rng: random.Random) -> int:
    low = max(1, math.floor(spec.input_len * (1 - spec.range_ratio)))
    high = max(low, math.ceil(spec.input_len * (1 + spec.range_ratio)))
    return rng.randint(low, high)


def _shared_prefix_texts(spec: DatasetSpec, source: TextSource, rng: random.Random) -> list[str]:
    texts = []
    for _ in range(spec.num_prefix_groups):
        system_prompt = source.text(spec.prefix_len)
        texts.extend(
            f"{system_prompt}\n{source.text(_jittered(spec, rng))}" for _ in range(spec.prompts_per_group)
        )
    rng.shuffle(texts)  # groups interleave, as users of different system prompts do
    return texts
