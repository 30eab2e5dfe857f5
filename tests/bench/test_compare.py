"""`bench compare`: the same prompts through firsttoken and transformers, with ratios."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from firsttoken.bench.compare import CompareSpec, compare_peers, format_report
from firsttoken.bench.peers import FirsttokenPeer, PeerTiming, TransformersPeer, timing_from


@dataclass
class _ScriptedPeer:
    """A peer whose timings are fixed, and which remembers the prompts it was given."""

    name: str
    ttft_s: float
    decode_tokens_per_s: float
    note: str = "scripted"

    def __post_init__(self) -> None:
        self.prompts: list[list[int]] = []

    def time_prompt(self, prompt_ids: list[int], output_len: int) -> PeerTiming:
        self.prompts.append(prompt_ids)
        return PeerTiming(self.ttft_s, self.decode_tokens_per_s)


def test_peers_get_the_same_prompts_and_ratios_favour_the_faster(llm):
    ours, theirs = _ScriptedPeer("firsttoken", 0.010, 200.0), _ScriptedPeer("other", 0.030, 50.0)
    spec = CompareSpec(input_lens=(24, 40), output_len=4, runs=2, warmup_runs=1)
    results = compare_peers([ours, theirs], llm.tokenizer, spec)
    assert ours.prompts == theirs.prompts
    assert [len(prompt) for prompt in ours.prompts] == [24, 24, 24, 40, 40, 40]
    assert len({tuple(prompt) for prompt in ours.prompts}) == 6  # every run is a fresh prompt
    assert [(r.peer, r.input_len, len(r.runs)) for r in results] == [
        ("firsttoken", 24, 2),
        ("other", 24, 2),
        ("firsttoken", 40, 2),
        ("other", 40, 2),
    ]
    report = format_report(results, [ours, theirs], spec)
    assert report.count("3.00x") == 2 and report.count("4.00x") == 2


def test_timing_from_stamps():
    assert timing_from(1.0, 1.5, 2.5, 11) == PeerTiming(0.5, 10.0)
    assert timing_from(1.0, 1.5, 1.5, 1) == PeerTiming(0.5, None)


def test_firsttoken_and_transformers_on_the_same_weights(llm, hf_model):
    peers = [FirsttokenPeer(llm), TransformersPeer(hf_model)]
    spec = CompareSpec(input_lens=(32,), output_len=4, runs=1, warmup_runs=0)
    results = compare_peers(peers, llm.tokenizer, spec)
    for result in results:
        (run,) = result.runs
        assert run.ttft_s > 0 and run.decode_tokens_per_s > 0, result
    report = format_report(results, peers, spec)
    assert "firsttoken speed-up vs transformers" in report and report.count("x") >= 2


def test_a_missing_transformers_is_a_clear_error(monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name: None if name == "transformers" else real_find_spec(name)
    )
    with pytest.raises(ValueError, match="transformers is not installed"):
        TransformersPeer.load("unused", None)
