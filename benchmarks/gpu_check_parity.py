"""Greedy parity with transformers: every greedy token of ours scored against transformers'
float32 forward on the same (rounded) weights given the same context, near ties apart, and our
first-token log-probs against float32's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from gpu_check_models import random_prompt
from gpu_check_plan import Plan, Shape

from firsttoken import LLM, SamplingParams


# Our dtype rounds where float32 does not: a greedy token may differ where the float32 top two
# logits are this close; beyond it a different token is a bug. Log-prob tolerance likewise.
NEAR_TIE = {torch.bfloat16: 0.25, torch.float32: 1e-3}
LOGPROB_TOLERANCE = {torch.bfloat16: 0.25, torch.float32: 1e-3}


@dataclass(frozen=True)
class ParityResult:
    """One prompt's greedy tokens checked against transformers."""

    shape: str
    prompt_tokens: int
    cached_tokens: int  # prompt tokens read from the prefix cache (then computed as a chunk on them)
    new_tokens: int
    same_as_reference_greedy: int  # leading tokens equal to transformers' float32 greedy run
    near_ties: int
    clear_misses: int
    first_token_logprob_error: float
    logprob_tolerance: float

    @property
    def passed(self) -> bool:
        return self.clear_misses == 0 and self.first_token_logprob_error <= self.logprob_tolerance


def count_misses(our_tokens: list[int], reference_logits: torch.Tensor, near_tie: float) -> tuple[int, int]:
    """(near ties, clear misses): positions where our token is not the reference argmax, split by
    whether the reference's best logit beats its logit of our token by at most `near_tie`.

    reference_logits [len(our_tokens), vocab]: row i given the prompt and our tokens before i.
    """
    near_ties = clear_misses = 0
    for position, token in enumerate(our_tokens):
        row = reference_logits[position]
        best = int(row.argmax())
        if token == best:
            continue
        if float(row[best] - row[token]) <= near_tie:
            near_ties += 1
        else:
            clear_misses += 1
    return near_ties, clear_misses


def leading_matches(ours: list[int], reference: list[int]) -> int:
    count = 0
    for ours_token, reference_token in zip(ours, reference):
        if ours_token != reference_token:
            break
        count += 1
    return count


def check_parity(
    llm: LLM, hf_model: Any, shape: Shape, plan: Plan, device: torch.device, seed: int
) -> list[ParityResult]:
    """Prompts in two rounds; the second's first prompt shares 512 tokens (or half) of the first
    round's longest, so it is computed as a chunk on cached context."""
    first_round = [
        random_prompt(length, f"parity-{seed}-{length}", shape.vocab_size) for length in plan.parity_lengths
    ]
    longest = max(first_round, key=len)
    shared = min(512, len(longest) // 2)
    second_round = [longest[:shared] + random_prompt(40, f"parity-{seed}-tail", shape.vocab_size)]
    params = SamplingParams(temperature=0, max_tokens=plan.parity_new_tokens, ignore_eos=True, logprobs=5)
    results = []
    for prompts in (first_round, second_round):
        for prompt, output in zip(prompts, llm.generate(prompt_token_ids=prompts, sampling_params=params)):
            results.append(_parity_of(hf_model, shape, plan, device, prompt, output))
    return results


@torch.inference_mode()
def _parity_of(
    hf_model: Any, shape: Shape, plan: Plan, device: torch.device, prompt: list[int], output
) -> ParityResult:
    ours = output.token_ids
    sequence = torch.tensor([prompt + ours[:-1]], device=device)
    logits = hf_model(sequence).logits[0, len(prompt) - 1 :].float().cpu()
    near_ties, clear_misses = count_misses(ours, logits, NEAR_TIE[plan.dtype])
    reference_logprobs = torch.log_softmax(logits[0], dim=-1)
    first_error = max(
        abs(alternative.logprob - float(reference_logprobs[alternative.token_id]))
        for alternative in output.logprobs[0].top_logprobs
    )
    generated = hf_model.generate(
        torch.tensor([prompt], device=device),
        max_new_tokens=len(ours),
        do_sample=False,
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=device),
        pad_token_id=0,
    )
    reference_greedy = generated[0, len(prompt) :].tolist()
    return ParityResult(
        shape=shape.name,
        prompt_tokens=len(prompt),
        cached_tokens=output.num_cached_tokens,
        new_tokens=len(ours),
        same_as_reference_greedy=leading_matches(ours, reference_greedy),
        near_ties=near_ties,
        clear_misses=clear_misses,
        first_token_logprob_error=first_error,
        logprob_tolerance=LOGPROB_TOLERANCE[plan.dtype],
    )
