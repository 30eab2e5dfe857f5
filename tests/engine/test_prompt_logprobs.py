"""Prompt logprobs (SamplingParams.prompt_logprobs) against transformers' float32 log-softmax."""

from __future__ import annotations

import pytest
import torch

from firsttoken import SamplingParams
from firsttoken.core.batch import PromptLogprobSpec, ScheduledChunk
from firsttoken.worker.prompt_logprobs import MAX_ROWS_PER_SLICE, find_prompt_rows
from firsttoken.worker.step_inputs import build_host_step
from tests.prompts import long_prompt

TOLERANCE = 1e-3


def _hf_logprobs(hf_model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = hf_model(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)  # [T, vocab]


def _check_against_hf(hf_model, token_ids: list[int], prompt_logprobs, num_top: int) -> None:
    reference = _hf_logprobs(hf_model, token_ids)
    assert len(prompt_logprobs) == len(token_ids) and prompt_logprobs[0] is None
    for position, scored in enumerate(prompt_logprobs[1:], start=1):
        row = reference[position - 1]
        assert scored.token_id == token_ids[position]
        assert abs(scored.logprob - row[token_ids[position]].item()) < TOLERANCE, position
        target = row[token_ids[position]]
        # Tokens within the tolerance of the target may rank either side of it.
        lowest, highest = (int((row > target + sign * TOLERANCE).sum()) + 1 for sign in (1, -1))
        assert lowest <= scored.rank <= highest
        top_values = torch.topk(row, num_top).values.tolist()
        assert [top.logprob for top in scored.top_logprobs] == pytest.approx(top_values, abs=TOLERANCE)


def test_prompt_logprobs_match_transformers(llm, hf_model):
    token_ids = llm.tokenizer.encode("The capital of France is Paris. The capital of Italy is")
    (output,) = llm.generate(
        prompt_token_ids=[token_ids],
        sampling_params=SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=3),
    )
    _check_against_hf(hf_model, token_ids, output.prompt_logprobs, 3)


def test_prompt_logprobs_of_a_chunked_prompt_past_one_lm_head_slice_match_transformers(llm, hf_model):
    # Longer than the fixture's 512-token chunks and than one slice of the LM head's rows.
    token_ids = llm.tokenizer.encode(long_prompt(6))  # 567 tokens
    assert len(token_ids) > 512 > MAX_ROWS_PER_SLICE
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    (output,) = llm.generate(prompt_token_ids=[token_ids], sampling_params=params)
    _check_against_hf(hf_model, token_ids, output.prompt_logprobs, 1)


def test_a_cached_prefix_still_gets_every_prompt_logprob(llm):
    token_ids = llm.tokenizer.encode(long_prompt(2))
    greedy = SamplingParams(temperature=0, max_tokens=2)
    (plain,) = llm.generate(prompt_token_ids=[token_ids], sampling_params=greedy)
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0)
    (scored,) = llm.generate(prompt_token_ids=[token_ids], sampling_params=params)
    (again,) = llm.generate(prompt_token_ids=[token_ids], sampling_params=params)
    assert scored.num_cached_tokens == 0 and again.num_cached_tokens == 0, "scoring skips the prefix cache"
    assert scored.token_ids == plain.token_ids
    assert len(again.prompt_logprobs) == len(token_ids)
    assert [t.logprob for t in again.prompt_logprobs[1:]] == [t.logprob for t in scored.prompt_logprobs[1:]]
    assert all(t.top_logprobs == [] for t in scored.prompt_logprobs[1:])


def test_prompt_rows_follow_each_chunks_rows_in_a_mixed_step():
    decode = ScheduledChunk("a", [7], 9, [0], None)
    prompt = ScheduledChunk("b", [1, 2, 3, 4], 4, [1], None, prefill=True,
                            prompt_logprobs=PromptLogprobSpec(5, [3, 4, 9], 2))
    rows = find_prompt_rows(build_host_step([prompt, decode], block_size=16))
    assert rows is not None
    # The decode's row comes first; the prompt chunk's rows 1..3 (positions 5..7) score.
    assert rows.rows.tolist() == [2, 3, 4]
    assert rows.target_token_ids.tolist() == [3, 4, 9] and rows.owners == [("b", 3)]


def test_prompt_logprobs_is_validated():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
