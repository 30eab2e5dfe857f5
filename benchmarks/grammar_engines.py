"""Grammar engines on our tokenizer: xgrammar against llguidance.

    python benchmarks/grammar_engines.py [--repeats 20]

Both engines get the embedded model's vocabulary as our tokenizer builds it from the GGUF
(token byte strings, special tokens, end-of-sequence ids; no hub); llguidance exactly as the
engine sets it up (sample/grammar.py), JSON in the engine's compact style. xgrammar is not a
dependency of firsttoken: `pip install xgrammar==0.2.9` to run this. For each grammar below this
prints, as medians over --repeats runs taken in turns (xgrammar, llguidance, xgrammar, ...):
- compile: a fresh compilation of the grammar (no cache), what a request with a new schema waits;
- first mask: the first token mask of a new matcher over a compiled grammar;
- per-token mask: filling the next token mask after each token of a valid output, the work a
  constrained request adds to each decode step;
and the tokenizer set-up once. Ratios are xgrammar / llguidance (above 1: llguidance faster).
On a machine shared with other work the ratios, timed in turns, hold better than the absolute
times.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import llguidance
import llguidance.torch
import torch
import xgrammar

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import print_table  # noqa: E402

from firsttoken.models.registry import default_model_path, open_checkpoint  # noqa: E402
from firsttoken.sample.grammar import JSON_STYLE, GrammarCompiler  # noqa: E402
from firsttoken.tokenizer import Tokenizer  # noqa: E402

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
ORDER = {
    "type": "object",
    "properties": {
        "order_id": {"type": "integer"},
        "status": {"enum": ["pending", "shipped", "delivered"]},
        "paid": {"type": "boolean"},
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string"},
                    "quantity": {"type": "integer"},
                    "price": {"type": "number"},
                },
                "required": ["sku", "quantity", "price"],
            },
        },
        "customer": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "email": {"type": "string"}},
            "required": ["name"],
        },
    },
    "required": ["order_id", "status", "items"],
}
GRAMMARS = {
    "json schema: person": ("json", json.dumps(PERSON), '{"name": "Ada Lovelace", "age": 36}'),
    "json schema: order": (
        "json",
        json.dumps(ORDER),
        '{"order_id": 1042, "status": "shipped", "paid": true, "items": [{"sku": "A-17", "quantity": 2, '
        '"price": 9.5}, {"sku": "B-3", "quantity": 1, "price": 120.25}], "customer": {"name": "Grace", '
        '"email": "grace@example.com"}}',
    ),
    "any json object": ("json_object", "", '{"city": "Paris", "population": 2102650, "capital": true}'),
    "regex: date": ("regex", r"\d{4}-\d{2}-\d{2}", "2024-06-30"),
}


class XGrammarEngine:
    name = "xgrammar"

    def __init__(self, vocabulary: list[bytes], stop_token_ids: list[int]) -> None:
        self.info = xgrammar.TokenizerInfo(
            vocabulary, xgrammar.VocabType.RAW, vocab_size=len(vocabulary), stop_token_ids=stop_token_ids
        )
        self.compiler = xgrammar.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self.bitmask = xgrammar.allocate_token_bitmask(1, len(vocabulary))

    def compile(self, kind: str, spec: str) -> object:
        if kind in ("json", "json_object"):
            schema = spec if kind == "json" else '{"type": "object"}'
            return self.compiler.compile_json_schema(schema, any_whitespace=False, separators=(", ", ": "))
        return self.compiler.compile_regex(spec)

    def matcher(self, compiled: object) -> object:
        return xgrammar.GrammarMatcher(compiled)

    def fill(self, matcher: object) -> None:
        matcher.fill_next_token_bitmask(self.bitmask, 0)

    def accept(self, matcher: object, token_id: int) -> None:
        assert matcher.accept_token(token_id)


class LLGuidanceEngine:
    name = "llguidance"

    def __init__(self, tokenizer: Tokenizer) -> None:
        # The engine's own set-up: llguidance over our tokenizer's token bytes.
        self.tokenizer = GrammarCompiler(tokenizer, tokenizer.vocab_size).engine_tokenizer()
        self.bitmask = llguidance.torch.allocate_token_bitmask(1, tokenizer.vocab_size)

    def compile(self, kind: str, spec: str) -> object:
        if kind == "json":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(spec, defaults=JSON_STYLE)
        elif kind == "json_object":
            grammar = llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_STYLE)
        else:
            grammar = llguidance.LLMatcher.grammar_from_regex(spec)
        # llguidance compiles when a matcher is built: this matcher is the compiled grammar.
        matcher = llguidance.LLMatcher(self.tokenizer, grammar)
        assert not matcher.is_error(), matcher.get_error()
        return grammar

    def matcher(self, compiled: object) -> object:
        return llguidance.LLMatcher(self.tokenizer, compiled)

    def fill(self, matcher: object) -> None:
        llguidance.torch.fill_next_token_bitmask(matcher, self.bitmask, 0)

    def accept(self, matcher: object, token_id: int) -> None:
        assert matcher.consume_token(token_id), matcher.get_error()


def seconds(function) -> float:
    started = time.perf_counter()
    function()
    return time.perf_counter() - started


def per_token_seconds(
    engine, compiled: object, token_ids: list[int], stop_token_id: int
) -> tuple[float, float]:
    """(first mask, median of the later masks) over a valid output followed by the stop token."""
    matcher = engine.matcher(compiled)
    first = seconds(lambda: engine.fill(matcher))
    later = []
    for token_id in [*token_ids, stop_token_id][:-1]:
        engine.accept(matcher, token_id)
        later.append(seconds(lambda: engine.fill(matcher)))
    return first, statistics.median(later)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = open_checkpoint(default_model_path()).tokenizer
    added = set(tokenizer.backend.get_added_tokens_decoder())
    vocabulary = [
        b"" if token_id in added else tokenizer.token_bytes(token_id)
        for token_id in range(tokenizer.vocab_size)
    ]
    stop_token_ids = sorted(tokenizer.eos_token_ids)
    setup = {
        "xgrammar": seconds(lambda: XGrammarEngine(vocabulary, stop_token_ids)),
        "llguidance": seconds(lambda: LLGuidanceEngine(tokenizer)),
    }
    engines = [XGrammarEngine(vocabulary, stop_token_ids), LLGuidanceEngine(tokenizer)]
    print(
        f"tokenizer set-up: xgrammar {setup['xgrammar'] * 1e3:.1f} ms, llguidance "
        f"{setup['llguidance'] * 1e3:.1f} ms"
    )
    rows = []
    for label, (kind, spec, valid_output) in GRAMMARS.items():
        token_ids = tokenizer.encode(valid_output, add_special_tokens=False)
        samples: dict[str, dict[str, list[float]]] = {
            engine.name: {"compile": [], "first": [], "token": []} for engine in engines
        }
        for _ in range(args.repeats):
            for engine in engines:
                samples[engine.name]["compile"].append(seconds(lambda: engine.compile(kind, spec)))
                first, per_token = per_token_seconds(
                    engine, engine.compile(kind, spec), token_ids, stop_token_ids[0]
                )
                samples[engine.name]["first"].append(first)
                samples[engine.name]["token"].append(per_token)
        medians = {
            name: {key: statistics.median(values) * 1e3 for key, values in by_key.items()}
            for name, by_key in samples.items()
        }
        xgr, llg = medians["xgrammar"], medians["llguidance"]
        for key, title in (
            ("compile", "compile ms"),
            ("first", "first mask ms"),
            ("token", "per-token mask ms"),
        ):
            rows.append([label, title, xgr[key], llg[key], xgr[key] / llg[key]])
    print_table(["grammar", "measure", "xgrammar", "llguidance", "xgr / llg"], rows)


if __name__ == "__main__":
    main()
