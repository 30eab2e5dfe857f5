"""Scheduling for TTFT objectives (earliest deadline first, whole steps and decodes sitting out
a step while a prefill is at risk) changes when tokens are computed, never which: greedy tokens
equal those of the engine without objectives (on the 2-layer model: what is checked is the
engine, not the words). The policy itself is in tests/core/test_slo.py."""

from __future__ import annotations

import statistics

from firsttoken import LLM, SamplingParams
from tests.conftest import FIXED_THREADS
from tests.prompts import SHORT_PROMPTS, long_prompt

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def test_greedy_tokens_are_those_without_an_objective(two_layer_model_path, engine_for):
    # 64-token steps: the prompts take turns over many steps, in a different order with objectives.
    plain = engine_for(model=two_layer_model_path, dtype="float32", max_num_batched_tokens=64, chunk_size=64)
    story = plain.tokenizer.encode(long_prompt(4))
    prompts = [plain.tokenizer.encode(text) for text in SHORT_PROMPTS] + [story[:300], story[:180]]
    expected = plain.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    # An objective near the batch's median TTFT: some prompts are served earliest deadline first,
    # the others (predicted to miss) best effort after them.
    objective_ms = 1000 * statistics.median(output.metrics.ttft_s for output in expected)
    with_objective = LLM(
        two_layer_model_path,
        dtype="float32",
        max_num_batched_tokens=64,
        ttft_slo_ms=objective_ms,
        **FIXED_THREADS,
    )
    outputs = with_objective.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    assert [output.token_ids for output in outputs] == [output.token_ids for output in expected]
    stats = with_objective.stats()
    assert stats.num_slo_refusals == 0  # best effort: every request is served
    assert stats.num_free_kv_blocks == stats.num_kv_blocks
