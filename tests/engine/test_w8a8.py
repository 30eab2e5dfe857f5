"""Engines with W8A8 projections: the model's answer kept, first-token logprobs near the float
engine's, a request's bits the same alone and beside others, and a clear refusal where the CPU
cannot run it."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from firsttoken import LLM, SamplingParams
from firsttoken.errors import InvalidInputError
from firsttoken.ops import native_w8a8, w8a8_linear
from firsttoken.ops.native_w8a8_step import PrefillChunk
from firsttoken.ops.w8a8 import w8a8_unsupported_reason
from firsttoken.ops.w8a8_linear import W8A8Linear
from firsttoken.worker import model_loading, model_runner
from firsttoken.worker.whole_step_w8a8 import prefill_chunks
from tests.conftest import FIXED_THREADS

UNSUPPORTED = w8a8_unsupported_reason(torch.device("cpu"))
needs_exact_int8 = pytest.mark.skipif(UNSUPPORTED is not None, reason=f"{UNSUPPORTED}")
OPTIONS = dict(dtype="float32", kv_cache_memory_bytes=256 << 20, chunk_size=512)
PROMPTS = [
    "The three primary colors are",
    "Write a haiku about autumn leaves falling on a quiet river, then explain the image it draws.",
    "What is 17 times 23? Show each step of the multiplication.",
]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=3)
# Over these replies' 48 tokens int8 activations and weights moved the float engine's logprobs by
# 0.12-0.15 on average (AVX-512 and AVX2 builds of a Zen 4, AMX); a broken product moves them by
# whole units.
MEAN_LOGPROB_SHIFT_LIMIT = 0.3
# The rotated engine's mean shift over the same tokens, as a share of the plain W8A8 engine's:
# 0.56 on a first-generation Zen (AVX2; 0.066 against 0.119).
ROTATED_SHIFT_SHARE = 0.8
# The rotated engine's mean shift on GPTQ's levels, as a share of its shift on the levels rounded
# to nearest.
GPTQ_SHIFT_SHARE = 0.95


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


def _teacher_forced_agreement(llm: LLM, prompts_and_replies: list[tuple[list[int], list[int]]]) -> float:
    """The share of the replies' tokens that are `llm`'s own likeliest next token."""
    agreeing = total = 0
    for reply, scored in _score_replies(llm, prompts_and_replies):
        agreeing += sum(entry.top_logprobs[0].token_id == token_id for token_id, entry in zip(reply, scored))
        total += len(reply)
    return agreeing / total


def _score_replies(llm: LLM, prompts_and_replies: list[tuple[list[int], list[int]]]):
    """Each reply with `llm`'s scored entries for its tokens, every one in its reply's context."""
    score = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    for prompt, reply in prompts_and_replies:
        (output,) = llm.generate(prompt_token_ids=[prompt + reply], sampling_params=score)
        yield reply, output.prompt_logprobs[len(prompt) :]


@needs_exact_int8
def test_logprobs_and_the_float_engines_replies_stay_near(w8a8_llm, engine_for):
    """Judged over every token of the float engine's replies, not token by token: unsmoothed int8
    activations of this small model are coarse enough that a float32 rounding elsewhere (another
    ISA's kernels) moved single logprobs by up to 2.8 and swapped close first tokens (0.72 apart
    in float32) on one CPU and not on another."""
    plain_outputs = engine_for(**OPTIONS).generate(PROMPTS, GREEDY)
    replies = [(output.prompt_token_ids, output.token_ids) for output in plain_outputs]
    shifts = [
        abs(entry.logprob - expected.logprob)
        for (_, scored), output in zip(_score_replies(w8a8_llm, replies), plain_outputs, strict=True)
        for entry, expected in zip(scored, output.logprobs, strict=True)
    ]
    assert sum(shifts) / len(shifts) <= MEAN_LOGPROB_SHIFT_LIMIT
    # A long text agrees on 0.888 of its tokens (docs/notes/cpu_measurements.md); a broken product
    # agrees on almost nothing.
    assert _teacher_forced_agreement(w8a8_llm, replies) >= 0.75


@needs_exact_int8
def test_a_request_gets_the_same_bits_alone_and_beside_others(w8a8_llm):
    """Each row's activation scale is its own and the int8 sums are exact, so the projections
    add nothing that depends on the batch."""
    together = w8a8_llm.generate(PROMPTS, GREEDY)
    for prompt, output in zip(PROMPTS, together, strict=True):
        (alone,) = w8a8_llm.generate([prompt], GREEDY)
        assert _bits(alone) == _bits(output)


class ServedSteps:
    """Wraps a runner's whole-step W8A8 forward, recording the layout of each step it runs."""

    def __init__(self, whole_step) -> None:
        self.whole_step = whole_step
        self.layouts = []

    def takes(self, layout) -> bool:
        return self.whole_step.takes(layout)

    def run(self, input_ids, positions, slot_mapping, layout):
        self.layouts.append(layout)
        return self.whole_step.run(input_ids, positions, slot_mapping, layout)


def _step_workload(llm: LLM) -> list[tuple]:
    """Prompts batched into one step beside a prompt long enough to be chunked (its later chunks
    beside the others' decodes, attending to their context in the cache), that prompt again alone,
    then a prompt whose prefix the prompt cache holds (a request for prompt logprobs takes none);
    each reply's tokens, logprobs and prompt logprobs."""
    scored = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    long_prompt = " ".join(PROMPTS * 6)
    outputs = llm.generate([*PROMPTS, long_prompt], scored)
    outputs += llm.generate([long_prompt], scored)
    outputs += llm.generate([long_prompt + " In short:"], GREEDY)
    return [
        (output.token_ids, repr(output.logprobs), repr(output.prompt_logprobs), output.num_cached_tokens)
        for output in outputs
    ]


@needs_exact_int8
@pytest.mark.parametrize("rotated, batch_invariant", [(False, True), (True, True), (True, False)])
def test_the_whole_step_forward_gives_the_per_op_bits(
    two_layer_model_path, monkeypatch, rotated, batch_invariant
):
    """A bf16 W8A8 engine on AVX512-BF16 kernels runs each step in one native call, every layer's
    kernels back to back: the same tokens, logprobs and prompt logprobs as the model's forward
    calling them one by one, for prefills batched in a step, decode-only steps, decodes beside a
    chunk of a prompt (whose context it reads in place) and a prompt on a cached prefix; decode
    rows with the prefill kernel's arithmetic (batch invariance) or the exact paged kernel's."""
    options = dict(
        batch_invariant=batch_invariant,
        model=two_layer_model_path, quantization="w8a8", w8a8_rotation=rotated, dtype="bfloat16",
        kv_cache_memory_bytes=64 << 20, chunk_size=64, max_num_batched_tokens=128, enable_prompt_cache=True,
        **FIXED_THREADS,
    )
    replies = {}
    for whole_step in (True, False):
        if not whole_step:
            monkeypatch.setattr(model_runner, "build_whole_step_w8a8", lambda model: None)
        llm = LLM(**options)
        try:
            runner = llm.core.worker.runner
            if whole_step:
                if runner.whole_step_w8a8 is None:
                    pytest.skip("no whole-step W8A8 forward here (AVX512-BF16 kernels, native int8 matmul)")
                served = runner.whole_step_w8a8 = ServedSteps(runner.whole_step_w8a8)
            replies[whole_step] = _step_workload(llm)
        finally:
            llm.shutdown()
    assert replies[True] == replies[False]
    layouts = served.layouts
    assert any(layout.num_decodes == 0 and len(layout.sequences) > 1 for layout in layouts)
    assert any(layout.num_decodes == len(layout.sequences) for layout in layouts)
    chunks_beside_decodes = [
        chunk for layout in layouts if 0 < layout.num_decodes < len(layout.sequences)
        for chunk in prefill_chunks(layout)
    ]
    assert any(chunk.num_context_tokens for chunk in chunks_beside_decodes)
    # Context read in place (consecutive blocks) and gathered (not).
    chunks = [chunk for layout in layouts for chunk in prefill_chunks(layout)]
    assert {chunk.first_slot >= 0 for chunk in chunks if chunk.num_context_tokens} == {True, False}
    assert replies[True][-1][3] > 0  # the last prompt's prefix came from the cache


@needs_exact_int8
def test_a_whole_step_slot_outside_the_cache_is_refused(two_layer_model_path):
    llm = LLM(
        model=two_layer_model_path, quantization="w8a8", dtype="bfloat16", kv_cache_memory_bytes=64 << 20,
        **FIXED_THREADS,
    )
    try:
        whole_step = llm.core.worker.runner.whole_step_w8a8
        if whole_step is None:
            pytest.skip("no whole-step W8A8 forward here (AVX512-BF16 kernels, native int8 matmul)")
        model = llm.core.worker.model
        hidden = model.embed_tokens(torch.tensor([5, 6, 7]))
        cos, sin = model.rotary_embedding(torch.arange(3), hidden.dtype)
        kv_cache = model.layers[0].self_attn.kv_cache
        outside = torch.tensor([0, 1, kv_cache.shape[1] * kv_cache.shape[2]], dtype=torch.long)
        chunks = [PrefillChunk(first_row=0, num_rows=3, num_context_tokens=0, block_ids=[0], first_slot=0)]
        with pytest.raises(IndexError, match="outside the KV cache"):
            whole_step.native_step.run(hidden, cos, sin, outside, None, chunks)
    finally:
        llm.shutdown()


@needs_exact_int8
@pytest.mark.parametrize("rotated", [False, True])
def test_swiglu_made_in_the_quantization_pass_gives_the_unfused_bits(
    two_layer_model_path, monkeypatch, rotated
):
    """W8A8's down_proj makes SwiGLU's product inside its quantization pass; the same engine
    with the product written out first (silu_and_mul, then the pass) replies with the same bits,
    the rotated one (its down_proj inputs turned in the pass) too."""
    options = dict(
        OPTIONS, model=two_layer_model_path, quantization="w8a8", w8a8_rotation=rotated, **FIXED_THREADS
    )
    replies = {}
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(W8A8Linear, "takes_silu_gated_inputs", property(lambda self: False))
        llm = LLM(**options)
        try:
            if fused and not llm.core.worker.model.layers[0].mlp.down_proj.takes_silu_gated_inputs:
                pytest.skip("no native quantization pass in this build")
            replies[fused] = [_bits(output) for output in llm.generate(PROMPTS, GREEDY)]
        finally:
            llm.shutdown()
    assert replies[True] == replies[False]


@needs_exact_int8
def test_the_native_int8_matmul_gives_the_onednn_engines_bits(two_layer_model_path, monkeypatch, caplog):
    """The engine runs W8A8 on the native kernels' int8 matmul where oneDNN's int8 sums saturate
    (AVX2 without VNNI), on VNNI CPUs and on AMX-INT8 tiles; each forced here, the replies carry the
    same bits as oneDNN's (on the 2-layer model of the embedded model's shapes)."""
    options = dict(OPTIONS, model=two_layer_model_path, quantization="w8a8", **FIXED_THREADS)
    replies = {}
    for on_native in (False, True):
        def chosen(kernels, on_native=on_native):
            return on_native and kernels is not None and kernels.w8a8.has_w8a8_matmul

        # The projections and the weights' form (shared by engines).
        for module in (w8a8_linear, model_loading):
            monkeypatch.setattr(module, "w8a8_on_native_matmul", chosen)
        with caplog.at_level(logging.INFO, logger="firsttoken.worker.model_loading"):
            llm = LLM(**options)
        try:
            native_kernels = llm.core.worker.kernels.native
            if native_kernels is None or not native_kernels.w8a8.has_w8a8_matmul:
                pytest.skip("no native int8 matmul in this build (x86 with AVX2 only)")
            projections = [m for m in llm.core.worker.model.modules() if isinstance(m, W8A8Linear)]
            assert projections and all(projection.native_matmul == on_native for projection in projections)
            multiplier = "the native int8 matmul on" if on_native else "oneDNN's int8 matmul"
            assert f"W8A8 projections multiply on {multiplier}" in caplog.text
            caplog.clear()
            replies[on_native] = [_bits(output) for output in llm.generate(PROMPTS, GREEDY)]
        finally:
            llm.shutdown()
    assert replies[True] == replies[False]


@needs_exact_int8
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_swiglu_epilogue_gives_the_engines_bits_without_it(two_layer_model_path, monkeypatch, dtype):
    """Where the int8 matmul stores SwiGLU's product (AVX512-VNNI, AMX-INT8), the replies carry
    the bits of the engine that writes gate | up and makes the product in down_proj's
    quantization pass."""
    options = dict(OPTIONS, model=two_layer_model_path, quantization="w8a8", dtype=dtype, **FIXED_THREADS)
    replies = {}
    for fused in (True, False):
        if not fused:
            without = property(lambda self: False)
            monkeypatch.setattr(native_w8a8.W8A8Kernels, "w8a8_matmul_makes_swiglu", without)
        llm = LLM(**options)
        try:
            gate_up_proj = llm.core.worker.model.layers[0].mlp.gate_up_proj
            if fused and not gate_up_proj.makes_swiglu_product:
                pytest.skip("this CPU's int8 matmul makes no SwiGLU product (AVX512-VNNI or AMX-INT8)")
            assert gate_up_proj.makes_swiglu_product == fused
            replies[fused] = [_bits(output) for output in llm.generate(PROMPTS, GREEDY)]
        finally:
            llm.shutdown()
    assert replies[True] == replies[False]


@needs_exact_int8
def test_quantizing_in_the_norms_gives_the_engines_bits_without_it(two_layer_model_path, monkeypatch):
    """qkv_proj and gate_up_proj take their inputs quantized by the RMSNorm's pass before them:
    the replies carry the bits of the engine that writes the normed rows and quantizes them."""
    options = dict(
        OPTIONS, model=two_layer_model_path, quantization="w8a8", dtype="bfloat16", **FIXED_THREADS
    )
    replies = {}
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(W8A8Linear, "takes_normed_rows", lambda self, x, residual, weight: False)
        llm = LLM(**options)
        try:
            if fused and llm.core.worker.kernels.native is None:
                pytest.skip("no native kernels: no norm pass to quantize in")
            replies[fused] = [_bits(output) for output in llm.generate(PROMPTS, GREEDY)]
        finally:
            llm.shutdown()
    assert replies[True] == replies[False]


def test_a_cpu_that_cannot_run_it_is_refused_naming_the_field(model_path, monkeypatch):
    monkeypatch.setattr(
        model_loading, "w8a8_unsupported_reason", lambda device, kernels=None: "w8a8 needs VNNI"
    )
    with pytest.raises(InvalidInputError, match="quantization: w8a8 needs VNNI"):
        LLM(model_path, quantization="w8a8", **OPTIONS)


@pytest.mark.slow  # a calibration run and a third engine
@needs_exact_int8
def test_calibrated_maxima_are_each_projections_largest_inputs_and_smooth_an_engine(
    engine_for, model_path, tmp_path
):
    from firsttoken.models.llama import layer_projections
    from firsttoken.calibration.calibrate import record_activation_maxima
    from firsttoken.worker.activation_stats import save_activation_maxima

    float_llm = engine_for(enable_prompt_cache=False, **OPTIONS)  # a cached prefix would not run
    model = float_llm.core.worker.model
    windows = [float_llm.tokenizer.encode(prompt) for prompt in PROMPTS]
    maxima = record_activation_maxima(float_llm, windows)
    assert sorted(maxima) == sorted(name for name, _, _ in layer_projections(model.layers))
    # The first layer's qkv input is its input norm of the embeddings: recomputed directly.
    embedded = model.embed_weight[torch.tensor([token for window in windows for token in window])]
    weight, eps = model.layers[0].input_norm_weight, model.arch.rms_norm_eps
    normed = F.rms_norm(embedded, (embedded.shape[-1],), weight, eps)
    torch.testing.assert_close(maxima["layers.0.qkv_proj"], normed.abs().amax(dim=0), rtol=1e-5, atol=1e-6)
    path = str(tmp_path / "maxima.safetensors")
    save_activation_maxima(path, maxima)
    smoothed = LLM(model_path, quantization="w8a8", w8a8_activation_stats=path, **OPTIONS)
    try:
        outputs = float_llm.generate(PROMPTS, GREEDY)
        replies = [(output.prompt_token_ids, output.token_ids) for output in outputs]
        assert _teacher_forced_agreement(smoothed, replies) >= 0.75
    finally:
        smoothed.shutdown()


@needs_exact_int8
def test_a_stats_file_for_another_model_is_refused_naming_the_field(model_path, tmp_path):
    from firsttoken.worker.activation_stats import save_activation_maxima

    path = str(tmp_path / "other.safetensors")
    save_activation_maxima(path, {"layers.0.qkv_proj": torch.ones(7)})
    with pytest.raises(InvalidInputError, match="w8a8_activation_stats: .* does not fit this model"):
        LLM(model_path, quantization="w8a8", w8a8_activation_stats=path, **OPTIONS)
    corrupt = tmp_path / "corrupt.safetensors"
    corrupt.write_bytes(b"abc")
    with pytest.raises(InvalidInputError, match="w8a8_activation_stats: cannot read"):
        LLM(model_path, quantization="w8a8", w8a8_activation_stats=str(corrupt), **OPTIONS)


def test_a_calibration_file_enters_the_projections_form_by_its_content(tmp_path):
    """Smoothed by other maxima, the same model computes other KV: prefix hashes and persisted
    pins tell them apart."""
    from firsttoken.config import ModelConfig
    from firsttoken.worker.activation_stats import save_activation_maxima
    from firsttoken.worker.pinned_prefix_store import projections_form

    path = str(tmp_path / "maxima.safetensors")
    save_activation_maxima(path, {"layers.0.qkv_proj": torch.ones(8)})
    first = projections_form(ModelConfig(quantization="w8a8", w8a8_activation_stats=path))
    save_activation_maxima(path, {"layers.0.qkv_proj": torch.full((8,), 2.0)})
    second = projections_form(ModelConfig(quantization="w8a8", w8a8_activation_stats=path))
    assert first.startswith("w8a8, calibrated ") and second.startswith("w8a8, calibrated ")
    assert first != second
    assert projections_form(ModelConfig(quantization="w8a8")) == "w8a8"


@pytest.fixture(scope="module")
def rotated_llm(engine_for, native_kernels):
    """Where W8A8 runs at all: on oneDNN's exact int8 sums or on the native int8 matmul (AVX2)."""
    reason = w8a8_unsupported_reason(torch.device("cpu"), native_kernels)
    if reason is not None:
        pytest.skip(reason)
    return engine_for(quantization="w8a8", w8a8_rotation=True, **OPTIONS)


def test_a_rotated_engine_quantizes_every_projection_behind_its_rotation(rotated_llm):
    model = rotated_llm.core.worker.model
    attention, mlp = model.layers[0].self_attn, model.layers[0].mlp
    projections = (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj)
    assert all(isinstance(projection, W8A8Linear) for projection in projections)
    assert [projection.hadamard_block for projection in projections] == [1, 1, 1, 512]
    assert not isinstance(model.lm_head, W8A8Linear)
    # The final norm's weight moved into the LM head.
    assert torch.equal(model.norm_weight, torch.ones_like(model.norm_weight))


def test_rotation_keeps_the_float_engines_replies_nearer_than_plain_w8a8(rotated_llm, w8a8_llm, engine_for):
    """Spread over every channel, the outliers leave the others more int8 levels: over the float
    engine's replies, the rotated engine's logprobs move less."""
    plain_outputs = engine_for(**OPTIONS).generate(PROMPTS, GREEDY)
    replies = [(output.prompt_token_ids, output.token_ids) for output in plain_outputs]
    assert _mean_logprob_shift(rotated_llm, plain_outputs) < ROTATED_SHIFT_SHARE * _mean_logprob_shift(
        w8a8_llm, plain_outputs
    )
    assert _teacher_forced_agreement(rotated_llm, replies) >= 0.75


def _mean_logprob_shift(llm: LLM, float_outputs) -> float:
    """How far `llm`'s logprobs of the float engine's replies lie from the float engine's own."""
    replies = [(output.prompt_token_ids, output.token_ids) for output in float_outputs]
    shifts = [
        abs(entry.logprob - expected.logprob)
        for (_, scored), output in zip(_score_replies(llm, replies), float_outputs, strict=True)
        for entry, expected in zip(scored, output.logprobs, strict=True)
    ]
    return sum(shifts) / len(shifts)


@pytest.mark.slow  # a GPTQ calibration of the embedded model (a minute) and another engine
def test_gptq_keeps_the_float_engines_replies_nearer_than_rounding_to_nearest(
    rotated_llm, engine_for, model_path, tmp_path
):
    """GPTQ's levels make the product with real inputs err less: over the float engine's replies
    the logprobs of the rotated engine on them move less than on the levels rounded to nearest."""
    from firsttoken.calibration.calibrate import calibrate
    from tests.prompts import long_prompt

    path = str(tmp_path / "gptq.safetensors")
    calibrate(model_path, long_prompt(), 2048, path, method="gptq")
    gptq_llm = LLM(
        model_path, quantization="w8a8", w8a8_rotation=True, w8a8_weights=path, **OPTIONS, **FIXED_THREADS
    )
    try:
        plain_outputs = engine_for(**OPTIONS).generate(PROMPTS, GREEDY)
        # Measured: 0.80x (0.046 against 0.058) on a first-generation Zen (AVX2).
        assert _mean_logprob_shift(gptq_llm, plain_outputs) < GPTQ_SHIFT_SHARE * _mean_logprob_shift(
            rotated_llm, plain_outputs
        )
    finally:
        gptq_llm.shutdown()


def test_a_rotated_request_gets_the_same_bits_alone_and_beside_others(rotated_llm):
    """The Hadamard transform of down_proj's inputs is a fixed sequence of additions per row."""
    together = rotated_llm.generate(PROMPTS, GREEDY)
    for prompt, output in zip(PROMPTS, together, strict=True):
        (alone,) = rotated_llm.generate([prompt], GREEDY)
        assert _bits(alone) == _bits(output)


def test_a_second_rotated_engine_shares_the_turned_weights_and_answers_the_same(
    rotated_llm, model_path, caplog
):
    """The turned embedding, norms and untied LM head are lent with the projections."""
    expected = rotated_llm.generate(PROMPTS, GREEDY)
    with caplog.at_level(logging.INFO):
        second = LLM(model_path, quantization="w8a8", w8a8_rotation=True, **OPTIONS, **FIXED_THREADS)
    try:
        assert "sharing the prepared weights" in caplog.text
        assert [_bits(output) for output in second.generate(PROMPTS, GREEDY)] == [_bits(o) for o in expected]
    finally:
        second.shutdown()


def test_a_float_engines_persisted_pin_is_refused_by_a_rotated_one(
    two_layer_model_path, tmp_path, native_kernels, caplog
):
    """A rotated model's values are in another basis: a float engine's saved KV would be garbage
    there, so the identity check names the projections."""
    reason = w8a8_unsupported_reason(torch.device("cpu"), native_kernels)
    if reason is not None:
        pytest.skip(reason)
    folder = str(tmp_path / "prompt-cache")
    writer = LLM(two_layer_model_path, prompt_cache_dir=folder, **OPTIONS, **FIXED_THREADS)
    writer.pin_prefix(" ".join(PROMPTS), pin_id="prefix")
    writer.shutdown()
    rotated = LLM(
        two_layer_model_path, prompt_cache_dir=folder, quantization="w8a8", w8a8_rotation=True,
        **OPTIONS, **FIXED_THREADS,
    )
    try:
        assert rotated.pinned_prefixes() == []
        assert "projections='float'" in caplog.text and "projections='w8a8, rotated'" in caplog.text
    finally:
        rotated.shutdown()


def test_rotation_without_w8a8_or_beside_stats_is_refused(model_path):
    with pytest.raises(InvalidInputError, match="w8a8_rotation: applies to quantization='w8a8' only"):
        LLM(model_path, w8a8_rotation=True, **OPTIONS)
    combined = "w8a8_rotation: cannot be combined with w8a8_activation_stats"
    with pytest.raises(InvalidInputError, match=combined):
        LLM(
            model_path, quantization="w8a8", w8a8_rotation=True, w8a8_activation_stats="stats.safetensors",
            **OPTIONS,
        )


def test_stats_without_w8a8_are_refused(model_path):
    with pytest.raises(InvalidInputError, match="w8a8_activation_stats: applies to quantization='w8a8' only"):
        LLM(model_path, w8a8_activation_stats="stats.safetensors", **OPTIONS)


@pytest.fixture(scope="module")
def gptq_weights_path(two_layer_model_path, tmp_path_factory, native_kernels) -> str:
    """`firsttoken quantize --method gptq`'s file for the two-layer model."""
    reason = w8a8_unsupported_reason(torch.device("cpu"), native_kernels)
    if reason is not None:
        pytest.skip(reason)
    from firsttoken.calibration.calibrate import calibrate

    path = str(tmp_path_factory.mktemp("gptq") / "weights.safetensors")
    calibrate(two_layer_model_path, " ".join(PROMPTS * 8), 512, path, method="gptq")
    return path


def _rotated_gptq_engine(model_path: str, weights_path: str) -> LLM:
    return LLM(
        model_path, quantization="w8a8", w8a8_rotation=True, w8a8_weights=weights_path,
        **OPTIONS, **FIXED_THREADS,
    )


def test_an_engine_multiplies_the_gptq_files_levels_behind_its_rotation(
    two_layer_model_path, gptq_weights_path
):
    from safetensors.torch import load_file

    from firsttoken.models.llama import layer_projections
    from firsttoken.worker.pinned_prefix_store import calibration_identity

    stored = load_file(gptq_weights_path)
    llm = _rotated_gptq_engine(two_layer_model_path, gptq_weights_path)
    try:
        layers = llm.core.worker.model.layers
        generator = torch.Generator().manual_seed(0)
        for name, owner, attribute in layer_projections(layers):
            projection = getattr(owner, attribute)
            assert isinstance(projection, W8A8Linear)
            levels, scales = stored[f"{name}.levels"], stored[f"{name}.scales"]
            x = torch.randn(5, levels.shape[1], generator=generator)
            expected = w8a8_linear.w8a8_linear_reference(
                x.double(), levels, scales, projection.bias, hadamard_block=projection.hadamard_block
            )
            if projection.makes_swiglu_product:
                gate, up = expected.chunk(2, dim=-1)
                expected = torch.nn.functional.silu(gate) * up
            # Rounded to nearest, a level in ten moves by one: that would move these by 1e-3.
            torch.testing.assert_close(projection(x).double(), expected, rtol=1e-5, atol=1e-5)
        assert layers[0].mlp.down_proj.hadamard_block == 512
        # Its KV is its own: the prefix hashes and persisted pins name the file.
        digest = calibration_identity(gptq_weights_path)
        assert len(digest) == 16 and f"w8a8, rotated, calibrated {digest}" in llm.core.worker.kv_identity
        assert all(output.token_ids for output in llm.generate(PROMPTS, GREEDY))
    finally:
        llm.shutdown()


def test_a_gptq_file_that_does_not_fit_the_model_is_refused_naming_the_field(
    two_layer_model_path, gptq_weights_path, tmp_path
):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    stored = load_file(gptq_weights_path)
    with safe_open(gptq_weights_path, framework="pt") as handle:
        metadata = handle.metadata()
    other = dict(stored, **{"layers.1.o_proj.levels": stored["layers.1.o_proj.levels"].flip(0)})
    save_file(other, str(tmp_path / "other.safetensors"), metadata=metadata)
    unfit = "w8a8_weights: .* does not fit this model: layers.1.o_proj's levels lie"
    with pytest.raises(InvalidInputError, match=unfit):
        _rotated_gptq_engine(two_layer_model_path, str(tmp_path / "other.safetensors"))
    missing = {key: value for key, value in stored.items() if not key.startswith("layers.1.down_proj")}
    save_file(missing, str(tmp_path / "missing.safetensors"), metadata=metadata)
    with pytest.raises(InvalidInputError, match="w8a8_weights: .* it lacks layers.1.down_proj"):
        _rotated_gptq_engine(two_layer_model_path, str(tmp_path / "missing.safetensors"))
    save_file({"layers.0.qkv_proj": torch.ones(576)}, str(tmp_path / "maxima.safetensors"))
    with pytest.raises(InvalidInputError, match="w8a8_weights: .* is not a file of W8A8 weights"):
        _rotated_gptq_engine(two_layer_model_path, str(tmp_path / "maxima.safetensors"))
    broken_scales = stored["layers.0.qkv_proj.scales"].clone()
    broken_scales[3] = float("nan")
    nan_scales = dict(stored, **{"layers.0.qkv_proj.scales": broken_scales})
    save_file(nan_scales, str(tmp_path / "nan.safetensors"), metadata=metadata)
    with pytest.raises(InvalidInputError, match="w8a8_weights: .* layers.0.qkv_proj's levels lie nan"):
        _rotated_gptq_engine(two_layer_model_path, str(tmp_path / "nan.safetensors"))
    (tmp_path / "corrupt.safetensors").write_bytes(b"abc")
    with pytest.raises(InvalidInputError, match="w8a8_weights: cannot read"):
        _rotated_gptq_engine(two_layer_model_path, str(tmp_path / "corrupt.safetensors"))


def test_gptq_weights_without_rotation_are_refused(model_path):
    unturned = "w8a8_weights: holds the weights of the model turned by w8a8_rotation"
    with pytest.raises(InvalidInputError, match=unturned):
        LLM(model_path, quantization="w8a8", w8a8_weights="weights.safetensors", **OPTIONS)
