"""LLM.inspect() and the engine's narrow surface for tools: what they say matches the engine."""

from __future__ import annotations

import pytest

from firsttoken import SamplingParams
from firsttoken.outputs import WHOLE_STEP_INT4_DECODE


def test_inspect_describes_the_engine(llm):
    inspection = llm.inspect()
    assert (inspection.architecture, inspection.num_layers, inspection.vocab_size) == ("llama", 30, 49152)
    assert inspection.dtype == "float32" and inspection.device == "cpu"
    assert inspection.quantization is None and inspection.checkpoint_quantization is None
    assert inspection.whole_step_forwards == ()
    assert inspection.tensor_parallel_size == 1 and inspection.graph_capture is None
    assert inspection.num_kv_blocks == llm.stats().num_kv_blocks
    assert inspection.block_size == llm.config.cache.block_size
    assert inspection.batch_invariant == llm.compute.batch_invariant
    assert inspection.start_up_choices == llm.compute.start_up_choices
    kernels = f"native kernels for {inspection.native_isa}" if inspection.native_isa else "torch ops"
    assert kernels in inspection.description


def test_the_single_rank_model_is_the_one_that_runs(llm):
    model = llm.core.single_rank_model()
    assert len(model.layers) == llm.inspect().num_layers
    prompt = [1, 2, 3, 4]
    calls = []
    hook = model.layers[0].register_forward_hook(lambda module, inputs, output: calls.append(module))
    try:
        llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(temperature=0, max_tokens=1))
    finally:
        hook.remove()
    assert calls


def test_an_int4_engine_names_its_whole_step_decode_and_sets_it_aside_while_asked(engine_for):
    llm = engine_for(dtype="float32", quantization="int4", kv_cache_memory_bytes=64 << 20)
    if llm.inspect().native_isa is None:
        pytest.skip("no native kernels here: no whole step to set aside")
    assert llm.inspect().whole_step_forwards == (WHOLE_STEP_INT4_DECODE,)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    (whole_step,) = llm.generate(prompt_token_ids=[[1, 2, 3, 4]], sampling_params=params)
    model = llm.core.single_rank_model()
    decode_calls = []
    hook = model.layers[0].register_forward_hook(lambda module, inputs, output: decode_calls.append(module))
    try:
        with llm.core.forward_op_by_op() as set_aside:
            assert set_aside == (WHOLE_STEP_INT4_DECODE,)
            assert llm.inspect().whole_step_forwards == ()
            (op_by_op,) = llm.generate(prompt_token_ids=[[1, 2, 3, 4]], sampling_params=params)
    finally:
        hook.remove()
    # The prefill and every decode step ran the model's layers (one call each step).
    assert len(decode_calls) == params.max_tokens
    assert llm.inspect().whole_step_forwards == (WHOLE_STEP_INT4_DECODE,)
    assert op_by_op.token_ids == whole_step.token_ids
