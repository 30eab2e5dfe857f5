"""transformers as the reference: greedy continuation and first-token log-probs."""

from __future__ import annotations

import torch


def hf_greedy(hf_model, prompt_ids: list[int], num_tokens: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy continuation and its log-probs at the last prompt position."""
    with torch.no_grad():
        output = hf_model(torch.tensor([prompt_ids]), use_cache=True)
        first_logprobs = torch.log_softmax(output.logits[0, -1].float(), dim=-1)
        cache = output.past_key_values
        next_id = int(output.logits[0, -1].argmax())
        generated = [next_id]
        for _ in range(num_tokens - 1):
            output = hf_model(torch.tensor([[next_id]]), past_key_values=cache, use_cache=True)
            cache = output.past_key_values
            next_id = int(output.logits[0, -1].argmax())
            generated.append(next_id)
    return generated, first_logprobs


def hf_logits_along(hf_model, prompt_ids: list[int], continuation_ids: list[int]) -> torch.Tensor:
    """transformers' logits [len(continuation_ids), vocab] at each position that chose a
    continuation token: the prompt's last, then after each continuation token but the last.

    One forward pass of the whole sequence. A continuation is transformers' greedy one exactly
    when each of its tokens is the argmax of its row (each step's context is then the one greedy
    decoding would have): the check costs a prefill, not a decode step per token. The LM head
    runs on those positions only (on the whole of a 1700-token prompt it would make 330 MB of
    logits no check reads)."""
    with torch.no_grad():
        sequence = torch.tensor([prompt_ids + continuation_ids[:-1]])
        return hf_model(sequence, logits_to_keep=len(continuation_ids)).logits[0].float()


def assert_logprobs_close(first_token_logprobs, expected_logprobs: torch.Tensor, tolerance: float) -> None:
    """Every returned top alternative's log-prob is within `tolerance` of the reference."""
    assert first_token_logprobs.top_logprobs, "no top logprobs returned"
    for alternative in first_token_logprobs.top_logprobs:
        reference = float(expected_logprobs[alternative.token_id])
        assert abs(alternative.logprob - reference) < tolerance, (alternative, reference)
