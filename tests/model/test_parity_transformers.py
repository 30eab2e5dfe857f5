"""Greedy tokens and prefill logits of firsttoken equal transformers' on the same GGUF weights."""

from __future__ import annotations

import pytest
import torch

from firsttoken import SamplingParams
from tests.model.reference import assert_logprobs_close, hf_greedy
from tests.prompts import CHAT_CONVERSATION, SHORT_PROMPTS, long_prompt

NUM_TOKENS = 32
TOP_LOGPROBS = 10
# float32 on both sides; the two implementations sum in different orders.
LOGPROB_TOLERANCE = 2e-3


@pytest.fixture(scope="module")
def parity_prompts(llm):
    chat_text = llm.tokenizer.apply_chat_template(CHAT_CONVERSATION)
    texts = SHORT_PROMPTS + [chat_text, long_prompt()]
    return [llm.tokenizer.encode(text) for text in texts]


def test_long_prompt_is_about_1500_tokens(parity_prompts):
    assert 1300 <= len(parity_prompts[-1]) <= 1800


def test_greedy_tokens_and_prefill_logprobs_match_transformers(llm, hf_model, parity_prompts):
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=TOP_LOGPROBS)
    outputs = llm.generate(prompt_token_ids=parity_prompts, sampling_params=params)
    for prompt_ids, output in zip(parity_prompts, outputs):
        expected_ids, expected_logprobs = hf_greedy(hf_model, prompt_ids, NUM_TOKENS)
        assert output.token_ids == expected_ids, f"prompt of {len(prompt_ids)} tokens diverged"
        first = output.logprobs[0]
        assert_logprobs_close(first, expected_logprobs, LOGPROB_TOLERANCE)
        expected_top = torch.topk(expected_logprobs, TOP_LOGPROBS).indices.tolist()
        assert [alternative.token_id for alternative in first.top_logprobs][:3] == expected_top[:3]
