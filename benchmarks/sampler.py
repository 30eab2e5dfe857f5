"""Sampler benchmark: the old per-row loop against the batched sampler.

    python benchmarks/sampler.py [--rows 1 8 16 32] [--vocab 49152] [--repeats 30] [--threads N]

For each row count R, R rows of logits over the vocabulary with a serving mix (cycling through
MIX: greedy, temperature with top-p 0.95 and top-k 40, the OpenAI defaults, seeded and unseeded,
some with logprobs) go through both samplers, timed in turns (old, new, old, new, ...) in one
process so drift in this machine's speed hits both alike; medians and old / new are printed.
The old sampler is kept here, as it was, as the baseline. On a machine shared with other work,
--threads 1 gives steadier numbers: every small op of the old loop waits on a team of threads.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import interleaved_medians, print_table, timed  # noqa: E402

from firsttoken.core.batch import SampleSpec  # noqa: E402
from firsttoken.outputs import SampledToken, TokenLogprob  # noqa: E402
from firsttoken.sample.sampler import Sampler, step_seed  # noqa: E402
from firsttoken.sampling_params import SamplingParams  # noqa: E402

NUCLEUS = dict(temperature=0.8, top_p=0.95, top_k=40)
MIX = [
    SamplingParams(**NUCLEUS),
    SamplingParams(temperature=0.0),
    SamplingParams(**NUCLEUS, seed=7),
    SamplingParams(**NUCLEUS, seed=8, logprobs=5),
    SamplingParams(temperature=0.0, logprobs=1),
    SamplingParams(temperature=1.0),
    SamplingParams(**NUCLEUS, seed=9),
    SamplingParams(temperature=0.0),
]


def old_filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if top_k > 0 and top_k < logits.shape[-1]:
        kth_largest = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        outside = sorted_probs.cumsum(-1) - sorted_probs >= top_p
        outside[0] = False
        logits = logits.masked_fill(torch.zeros_like(outside).scatter(0, order, outside), float("-inf"))
    return logits


class PerRowSampler:
    """The sampler before batching: a Python loop over the rows that do not take the argmax."""

    def __init__(self, seed: int, device: torch.device) -> None:
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def sample(self, logits: torch.Tensor, specs: list[SampleSpec]) -> list[SampledToken]:
        token_ids = torch.argmax(logits, dim=-1)
        for row, spec in enumerate(specs):
            if not spec.sampling_params.greedy:
                token_ids[row] = self._sample_row(logits[row], spec)
        token_list = token_ids.tolist()
        if all(spec.sampling_params.logprobs is None for spec in specs):
            return [SampledToken(token_id) for token_id in token_list]
        return self._with_logprobs(logits, token_ids, token_list, specs)

    def _sample_row(self, row_logits: torch.Tensor, spec: SampleSpec) -> torch.Tensor:
        params = spec.sampling_params
        filtered = old_filter_logits(row_logits / params.temperature, params.top_k, params.top_p)
        probs = filtered.softmax(-1)
        generator = self.generator
        if params.seed is not None:
            seed = step_seed(params.seed, spec.output_index)
            generator = torch.Generator(device=self.device).manual_seed(seed)
        return torch.multinomial(probs, 1, generator=generator)[0]

    @staticmethod
    def _with_logprobs(
        logits: torch.Tensor, token_ids: torch.Tensor, token_list: list[int], specs: list[SampleSpec]
    ) -> list[SampledToken]:
        logprobs = torch.log_softmax(logits, dim=-1)
        chosen = logprobs.gather(1, token_ids[:, None]).squeeze(1).tolist()
        max_top = max(spec.sampling_params.logprobs or 0 for spec in specs)
        top_values, top_ids = torch.topk(logprobs, max_top, dim=-1) if max_top else (None, None)
        results = []
        for row, spec in enumerate(specs):
            num_top = spec.sampling_params.logprobs
            if num_top is None:
                results.append(SampledToken(token_list[row]))
                continue
            row_ids, row_values = top_ids[row, :num_top].tolist(), top_values[row, :num_top].tolist()
            top = [
                TokenLogprob(int(token_id), float(value)) for token_id, value in zip(row_ids, row_values)
            ] if num_top else []
            results.append(SampledToken(token_list[row], chosen[row], top))
        return results


def lm_head_logits(num_rows: int, vocab_size: int) -> torch.Tensor:
    """float32 logits as a bf16 LM head gives them (ties included)."""
    logits = torch.randn(num_rows, vocab_size, generator=torch.Generator().manual_seed(num_rows)) * 3
    return logits.bfloat16().float()


def step_specs(num_rows: int, step: int) -> list[SampleSpec]:
    return [SampleSpec(MIX[row % len(MIX)], output_index=step, req_id=f"r{row}") for row in range(num_rows)]


def greedy_rows_agree(old: PerRowSampler, new: Sampler, logits: torch.Tensor) -> bool:
    specs = step_specs(logits.shape[0], 0)
    greedy_rows = [row for row, spec in enumerate(specs) if spec.sampling_params.greedy]
    old_tokens, new_tokens = old.sample(logits, specs), new.sample(logits, specs)
    return all(old_tokens[row] == new_tokens[row] for row in greedy_rows)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32])
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device("cpu")
    old, new = PerRowSampler(0, device), Sampler(0, device, args.vocab)
    print(f"vocabulary {args.vocab}, {torch.get_num_threads()} torch threads, {args.repeats} turns each")
    table = []
    for num_rows in args.rows:
        logits = lm_head_logits(num_rows, args.vocab)
        assert greedy_rows_agree(old, new, logits)
        medians = interleaved_medians(
            {
                "old": lambda step: timed(lambda: old.sample(logits, step_specs(num_rows, step))),
                "new": lambda step: timed(lambda: new.sample(logits, step_specs(num_rows, step))),
            },
            repeats=args.repeats,
            warmups=2,
        )
        table.append([num_rows, medians["old"] * 1e3, medians["new"] * 1e3, medians["old"] / medians["new"]])
    print_table(["rows", "old ms", "new ms", "old / new"], table)


if __name__ == "__main__":
    main()
