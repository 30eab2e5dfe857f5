"""Engines with W8A8 projections: the model's answer kept, first-token logprobs near the float
engine's, a request's bits the same alone and beside others, and a clear refusal where the CPU
cannot run it."""

from __future__ import annotations

import pytest
import torch

from firsttoken import LLM, SamplingParams
from firsttoken.errors import InvalidInputError
from firsttoken.ops.w8a8 import W8A8Linear, w8a8_unsupported_reason
from firsttoken.worker import model_loading

UNSUPPORTED = w8a8_unsupported_reason(torch.device("cpu"))
needs_exact_int8 = pytest.mark.skipif(UNSUPPORTED is not None, reason=f"{UNSUPPORTED}")
OPTIONS = dict(dtype="float32", kv_cache_memory_bytes=256 << 20, chunk_size=512)
PROMPTS = [
    "The three primary colors are",
    "Write a haiku about autumn leaves falling on a quiet river, then explain the image it draws.",
    "What is 17 times 23? Show each step of the multiplication.",
]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=3)
# int8 activations and weights moved these first logprobs by up to 0.34 on this 135M model (its
# perplexity on a long text rises ~4%, see docs/cpu.md); a broken product moves them by whole units.
FIRST_LOGPROB_TOLERANCE = 0.5


@pytest.fixture(scope="module")
def w8a8_llm(engine_for):
    return engine_for(quantization="w8a8", **OPTIONS)


def _bits(output) -> tuple:
    return tuple(output.token_ids), tuple(entry.logprob for entry in output.logprobs)


@needs_exact_int8
def test_every_layer_projection_is_w8a8_and_the_head_stays_float(w8a8_llm):
    model = w8a8_llm.core.worker.model
    layer = model.layers[0]
    attention, mlp = layer.self_attn, layer.mlp
    projections = (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj)
    assert all(isinstance(projection, W8A8Linear) for projection in projections)
    assert not isinstance(model.lm_head, W8A8Linear)


@needs_exact_int8
def test_the_answer_and_first_logprobs_stay_near_the_float_engine(w8a8_llm, engine_for):
    question = [{"role": "user", "content": "What is the capital of France?"}]
    answer = w8a8_llm.chat(question, SamplingParams(temperature=0, max_tokens=24))
    assert answer.text == "The capital of France is Paris."
    plain = engine_for(**OPTIONS)
    quantized_outputs, plain_outputs = w8a8_llm.generate(PROMPTS, GREEDY), plain.generate(PROMPTS, GREEDY)
    for quantized, full in zip(quantized_outputs, plain_outputs, strict=True):
        first, expected = quantized.logprobs[0], full.logprobs[0]
        assert first.token_id == expected.token_id
        assert abs(first.logprob - expected.logprob) <= FIRST_LOGPROB_TOLERANCE


@needs_exact_int8
def test_a_request_gets_the_same_bits_alone_and_beside_others(w8a8_llm):
    """Each row's activation scale is its own and the int8 sums are exact, so the projections
    add nothing that depends on the batch."""
    together = w8a8_llm.generate(PROMPTS, GREEDY)
    for prompt, output in zip(PROMPTS, together, strict=True):
        (alone,) = w8a8_llm.generate([prompt], GREEDY)
        assert _bits(alone) == _bits(output)


def test_a_cpu_that_cannot_run_it_is_refused_naming_the_field(model_path, monkeypatch):
    monkeypatch.setattr(model_loading, "w8a8_unsupported_reason", lambda device: "w8a8 needs VNNI")
    with pytest.raises(InvalidInputError, match="quantization: w8a8 needs VNNI"):
        LLM(model_path, quantization="w8a8", **OPTIONS)
