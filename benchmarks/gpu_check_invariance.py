"""Batch invariance in the device check: whether a prompt's bits are the same alone and beside
other requests, on the engine that claims invariance and on a plain one, and what it costs in
TTFT."""

from __future__ import annotations

import random
import statistics

import torch

from gpu_check_models import random_prompt, synchronize, timed_generate
from gpu_check_plan import Plan, Shape

from firsttoken import LLM, SamplingParams


# The batch-invariance check: a prompt alone, then beside this many random others.
INVARIANCE_OTHERS = 15
INVARIANCE_PROMPT_TOKENS = 300


def _output_bits(output) -> tuple:
    """A completion's tokens and every top log-prob, as exact floats: the logits' bits as far as
    the output shows them."""
    return tuple(output.token_ids), tuple(
        (entry.logprob, tuple((alt.token_id, alt.logprob) for alt in entry.top_logprobs))
        for entry in output.logprobs
    )


def same_bits_beside_others(llm: LLM, shape: Shape, plan: Plan, seed: int) -> bool:
    """Whether a prompt's greedy tokens and top-20 log-probs are the same bits alone as beside
    INVARIANCE_OTHERS random prompts of 1 to 600 tokens, which share its prefill step, then its
    decode steps (the second run also reads the prompt's cached prefix blocks)."""
    params = SamplingParams(
        temperature=0, max_tokens=plan.invariance_new_tokens, ignore_eos=True, logprobs=20
    )
    target = random_prompt(
        min(INVARIANCE_PROMPT_TOKENS, max(plan.ttft_lengths)), f"invariance-{seed}", shape.vocab_size
    )
    rng = random.Random(seed)
    others = [
        random_prompt(rng.randrange(1, 2 * len(target)), f"invariance-{seed}-other-{i}", shape.vocab_size)
        for i in range(INVARIANCE_OTHERS)
    ]
    alone = llm.generate(prompt_token_ids=[target], sampling_params=params)[0]
    beside = llm.generate(prompt_token_ids=others[:7] + [target] + others[7:], sampling_params=params)[7]
    return _output_bits(alone) == _output_bits(beside)


def check_batch_invariance(
    invariant: LLM, plain: LLM, shape: Shape, plan: Plan, device: torch.device, seed: int
) -> list[dict]:
    """Per engine: whether it claims invariance (the invariant one must, on CUDA), and whether
    a prompt's bits held beside others."""
    return [
        {
            "engine": name,
            "claimed": llm.inspect().batch_invariant,
            "must_claim": name == "invariant" and device.type == "cuda",
            "same_bits_beside_others": same_bits_beside_others(llm, shape, plan, seed),
        }
        for name, llm in (("invariant", invariant), ("plain", plain))
    ]


def measure_invariance_ttft(
    invariant: LLM, plain: LLM, shape: Shape, plan: Plan, device: torch.device, seed: int
) -> list[dict]:
    """TTFT with invariance on and off, timed in turns on the same prompts (median of 3 after a warm-up)."""
    rows = []
    for length in plan.invariance_lengths:
        if length >= shape.max_position_embeddings:
            continue
        timings: dict[str, list[float]] = {"invariant": [], "plain": []}
        for run in range(4):
            prompt = random_prompt(length, f"invariance-ttft-{seed}-{length}-{run}", shape.vocab_size)
            for name, llm in (("invariant", invariant), ("plain", plain)):
                synchronize(device)
                timings[name].append(timed_generate(llm, [prompt], 1))
        invariant_s, plain_s = (statistics.median(timings[name][1:]) for name in ("invariant", "plain"))
        rows.append(
            {
                "prompt_tokens": length,
                "invariant_s": invariant_s,
                "plain_s": plain_s,
                "ratio": invariant_s / plain_s,
            }
        )
    return rows
