"""`firsttoken bench compare`: firsttoken against its peers on the same prompts, in one run.

For each prompt length the peers take turns on the same fresh prompt (so they share the
machine's state), and the report shows medians side by side and as ratios to firsttoken
(above 1: firsttoken is faster).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from firsttoken.bench.datasets import TextSource
from firsttoken.bench.peers import Peer, PeerTiming
from tqdm import tqdm

from firsttoken.bench.table import format_table
from firsttoken.progress import progress_bar
from firsttoken.tokenizer import Tokenizer


@dataclass(frozen=True)
class CompareSpec:
    """Prompt lengths, tokens to generate, and how many runs per length."""

    input_lens: tuple[int, ...] = (128, 512)
    output_len: int = 32
    runs: int = 3
    warmup_runs: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.input_lens or min(self.input_lens) < 1:
            raise ValueError(f"input_lens: need lengths >= 1, got {self.input_lens}")
        for name in ("output_len", "runs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.warmup_runs < 0:
            raise ValueError(f"warmup_runs: must be >= 0, got {self.warmup_runs}")


@dataclass(frozen=True)
class PeerResult:
    """Medians of one peer at one prompt length, over the timed runs."""

    peer: str
    input_len: int
    ttft_s: float
    decode_tokens_per_s: float | None
    runs: list[PeerTiming]


def compare_peers(
    peers: Sequence[Peer], tokenizer: Tokenizer, spec: CompareSpec, show_progress: bool = False
) -> list[PeerResult]:
    """Time every peer on the same prompt token ids; warm-up runs are discarded."""
    source = TextSource(tokenizer, spec.seed)
    results = []
    num_runs = spec.warmup_runs + spec.runs
    total = len(spec.input_lens) * num_runs * len(peers)
    description = f"runs ({spec.warmup_runs} warm-up per length and peer)"
    with progress_bar(total, description, "run", show_progress) as bar:
        for input_len in spec.input_lens:
            timings = _time_peers(peers, tokenizer, source, input_len, spec, bar)
            results.extend(_peer_results(peers, input_len, timings))
    return results


def _time_peers(
    peers: Sequence[Peer], tokenizer: Tokenizer, source: TextSource, input_len: int, spec: CompareSpec,
    bar: tqdm,
) -> dict[str, list[PeerTiming]]:
    """Each peer's timed runs on prompts of `input_len` tokens, the same prompt for every peer."""
    timings: dict[str, list[PeerTiming]] = {peer.name: [] for peer in peers}
    for index in range(spec.warmup_runs + spec.runs):
        prompt_ids = tokenizer.encode(source.text(input_len))
        for peer in peers:
            timing = peer.time_prompt(prompt_ids, spec.output_len)
            if index >= spec.warmup_runs:
                timings[peer.name].append(timing)
            bar.update()
    return timings


def _peer_results(
    peers: Sequence[Peer], input_len: int, timings: dict[str, list[PeerTiming]]
) -> list[PeerResult]:
    results = []
    for peer in peers:
        runs = timings[peer.name]
        rates = [run.decode_tokens_per_s for run in runs if run.decode_tokens_per_s is not None]
        results.append(
            PeerResult(
                peer=peer.name,
                input_len=input_len,
                ttft_s=statistics.median(run.ttft_s for run in runs),
                decode_tokens_per_s=statistics.median(rates) if rates else None,
                runs=runs,
            )
        )
    return results


def format_report(results: Sequence[PeerResult], peers: Sequence[Peer], spec: CompareSpec) -> str:
    """Two tables (TTFT, decode rate): a column per peer, then each peer's ratio to firsttoken."""
    by_key = {(result.peer, result.input_len): result for result in results}
    base, others = peers[0], peers[1:]
    ttft_rows, decode_rows = [], []
    for input_len in spec.input_lens:
        ours = by_key[(base.name, input_len)]
        theirs = [by_key[(peer.name, input_len)] for peer in others]
        ttft_rows.append(
            [input_len, ours.ttft_s * 1000]
            + [result.ttft_s * 1000 for result in theirs]
            + [_ratio(result.ttft_s, ours.ttft_s) for result in theirs]
        )
        decode_rows.append(
            [input_len, _value(ours.decode_tokens_per_s)]
            + [_value(result.decode_tokens_per_s) for result in theirs]
            + [_ratio(ours.decode_tokens_per_s, result.decode_tokens_per_s) for result in theirs]
        )
    names = [peer.name for peer in peers]
    ratio_names = [f"{base.name} speed-up vs {peer.name}" for peer in others]
    notes = "; ".join(f"{peer.name}: {peer.note}" for peer in peers)
    return (
        f"same prompts, greedy, {spec.output_len} output tokens, median of {spec.runs} runs after "
        f"{spec.warmup_runs} warm-up ({notes})\n\n"
        "TTFT (ms)\n"
        + format_table(["prompt tokens", *names, *ratio_names], ttft_rows)
        + "\n\ndecode (tokens/s)\n"
        + format_table(["prompt tokens", *names, *ratio_names], decode_rows)
    )


def _value(value: float | None) -> float | str:
    return "-" if value is None else value


def _ratio(numerator: float | None, denominator: float | None) -> str:
    if numerator is None or not denominator:
        return "-"
    return f"{numerator / denominator:.2f}x"


def results_payload(results: Sequence[PeerResult], spec: CompareSpec) -> dict[str, object]:
    return {"spec": asdict(spec), "results": [asdict(result) for result in results]}
