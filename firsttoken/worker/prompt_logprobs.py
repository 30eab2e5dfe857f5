"""Prompt logprobs: each prompt token's log-probability given the tokens before it, from the
hidden states the prefill computes anyway.

The LM head runs over the scoring rows a bounded slice at a time, so a long prompt never holds
a [prompt_len, vocab] float32 tensor: at most [MAX_ROWS_PER_SLICE, vocab] at once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from firsttoken.outputs import SampledToken, TokenLogprob
from firsttoken.worker.step_inputs import HostStep

# [256, 49152] float32 logits (SmolLM2's vocabulary) are 48 MiB, plus their log-softmax.
MAX_ROWS_PER_SLICE = 256


@dataclass(frozen=True)
class PromptRows:
    """The step's rows that score prompt tokens, in row order, and whose they are."""

    rows: np.ndarray  # [N] int64: rows of the step's hidden states
    target_token_ids: np.ndarray  # [N] int64: the prompt token each row scores
    num_top: np.ndarray  # [N] int64: alternatives each row reports
    owners: list[tuple[str, int]]  # (req_id, its number of rows), in row order

    @property
    def num_rows(self) -> int:
        return int(self.rows.shape[0])


def find_prompt_rows(step: HostStep) -> PromptRows | None:
    """The scoring rows of the step's chunks that ask for prompt logprobs; None when none does."""
    rows, targets, num_top, owners = [], [], [], []
    chunk_start_row = 0
    for chunk in step.chunks:  # in row order
        spec = chunk.prompt_logprobs
        if spec is not None:
            first_row = chunk_start_row + spec.first_position - chunk.start_position
            rows.append(np.arange(first_row, first_row + spec.num_rows))
            targets.extend(spec.target_token_ids)
            num_top.extend([spec.num_top] * spec.num_rows)
            owners.append((chunk.req_id, spec.num_rows))
        chunk_start_row += chunk.num_tokens
    if not owners:
        return None
    return PromptRows(np.concatenate(rows), np.asarray(targets), np.asarray(num_top), owners)


def score_prompt_rows(
    compute_logits: Callable[[torch.Tensor], torch.Tensor | None],
    hidden: torch.Tensor,
    prompt_rows: PromptRows,
) -> dict[str, list[SampledToken]]:
    """Each owner's scored prompt tokens, from hidden states [T, hidden] of the whole step.

    `compute_logits` returns None on a tensor-parallel rank other than 0, which only sends its
    vocabulary slices (every rank runs the same slices in the same order); it then returns {}."""
    scored: list[SampledToken] = []
    for start in range(0, prompt_rows.num_rows, MAX_ROWS_PER_SLICE):
        end = min(start + MAX_ROWS_PER_SLICE, prompt_rows.num_rows)
        rows = torch.as_tensor(prompt_rows.rows[start:end], device=hidden.device)
        logits = compute_logits(hidden[rows])  # [n, vocab] float32
        if logits is None:
            continue
        targets = torch.as_tensor(prompt_rows.target_token_ids[start:end], device=logits.device)
        scored.extend(_score_slice(logits, targets, prompt_rows.num_top[start:end].tolist()))
    if not scored:
        return {}
    by_owner = {}
    offset = 0
    for req_id, num_rows in prompt_rows.owners:
        by_owner[req_id] = scored[offset : offset + num_rows]
        offset += num_rows
    return by_owner


def _score_slice(logits: torch.Tensor, targets: torch.Tensor, num_top: list[int]) -> list[SampledToken]:
    """logits [n, vocab], targets [n]: each target's logprob and rank, and each row's likeliest."""
    logprobs = torch.log_softmax(logits, dim=-1)  # [n, vocab]
    chosen = logprobs.gather(1, targets.unsqueeze(1))  # [n, 1]
    ranks = (logprobs > chosen).sum(-1) + 1  # [n]
    max_top = max(num_top)
    top_pairs: list[list[tuple[int, float]]] = [[] for _ in num_top]
    if max_top > 0:
        top_values, top_ids = torch.topk(logprobs, max_top, dim=-1)  # [n, max_top]
        top_pairs = [list(zip(ids, values)) for ids, values in zip(top_ids.tolist(), top_values.tolist())]
    return [
        SampledToken(target, logprob, [TokenLogprob(token_id, value) for token_id, value in top[:num]], rank)
        for target, logprob, rank, top, num in zip(
            targets.tolist(), chosen.squeeze(1).tolist(), ranks.tolist(), top_pairs, num_top
        )
    ]
