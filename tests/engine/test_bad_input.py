"""Bad input: a ValueError naming the field and its limit, and no KV block left behind."""

from __future__ import annotations

import dataclasses
import math
import os
import re

import pytest

from firsttoken import LLM, SamplingParams
from firsttoken.config import (
    SUBCONFIGS,
    CacheConfig,
    ChunkedPrefillConfig,
    EngineConfig,
    SchedulerConfig,
    flat_name,
)
from firsttoken.engine import InvalidInputError
from tests.conftest import FIXED_THREADS
from tests.engine_state import all_blocks_free

BAD_SAMPLING_PARAMS = [
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-3), "max_tokens"),
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=0), "top_k"),
    (dict(top_k=-2), "top_k"),
    (dict(logprobs=21), "logprobs"),
    (dict(stop=[""]), "stop"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-2.01), "frequency_penalty"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty=5e-324), "repetition_penalty"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty"),
    (dict(min_p=1.5), "min_p"),
    (dict(min_p=-0.1), "min_p"),
    (dict(logit_bias={5: 101.0}), "logit_bias[5]"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(logit_bias={"5": 1.0}), "logit_bias"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=17), "min_tokens"),
    (dict(stop_token_ids=[-2]), "stop_token_ids"),
    (dict(bad_words=[" "]), "bad_words"),
]


@pytest.mark.parametrize("kwargs,field", BAD_SAMPLING_PARAMS)
def test_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{re.escape(field)}: "):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs,field", BAD_SAMPLING_PARAMS)
def test_sampling_params_errors_carry_the_field(kwargs, field):
    """Front ends read the field from the error, not from its message."""
    with pytest.raises(InvalidInputError) as raised:
        SamplingParams(**kwargs)
    assert raised.value.field == field


@pytest.mark.parametrize(
    "kwargs,limit",
    [
        (dict(presence_penalty=3.0), "[-2, 2]"),
        (dict(frequency_penalty=-3.0), "[-2, 2]"),
        (dict(repetition_penalty=-1.0), ">= 1e-06"),
        (dict(min_p=2.0), "[0, 1]"),
        (dict(logit_bias={3: -150.0}), "[-100, 100]"),
        (dict(min_tokens=20, max_tokens=10), "max_tokens=10"),
    ],
)
def test_sampling_params_errors_state_the_limit(kwargs, limit):
    with pytest.raises(InvalidInputError) as raised:
        SamplingParams(**kwargs)
    assert limit in str(raised.value)


def test_empty_prompts_are_refused(llm):
    with pytest.raises(ValueError, match="prompts\\[0\\]"):
        llm.generate([""])
    with pytest.raises(ValueError, match="prompt_token_ids\\[0\\]"):
        llm.generate(prompt_token_ids=[[]])
    assert all_blocks_free(llm)


@pytest.mark.parametrize(
    "prompts, field",
    [
        ({"prompt_token_ids": []}, "prompts[0].prompt_token_ids"),
        ({"prompt_token_ids": "1 2 3"}, "prompts[0].prompt_token_ids"),
        ([{"prompt": ""}], "prompts[0].prompt"),
        (["fine", {"prompt": "x", "multi_modal_data": {}}], "prompts[1]"),
        ([{"text": "x"}], "prompts[0]"),
        ([7], "prompts[0]"),
    ],
)
def test_bad_prompt_dicts_name_the_entry(llm, prompts, field):
    with pytest.raises(InvalidInputError) as raised:
        llm.generate(prompts)
    assert raised.value.field == field
    assert all_blocks_free(llm)


def test_prompt_plus_max_tokens_over_max_model_len(model_path):
    llm = LLM(model_path, dtype="float32", kv_cache_memory_bytes=64 << 20, chunk_size=64, max_model_len=64,
              **FIXED_THREADS)
    with pytest.raises(ValueError, match=r"max_tokens: .*longer than max_model_len \(64\)"):
        llm.generate(["word " * 40], SamplingParams(max_tokens=30))
    assert all_blocks_free(llm)


def test_a_bad_request_in_a_batch_leaves_nothing_queued(model_path):
    llm = LLM(model_path, dtype="float32", kv_cache_memory_bytes=64 << 20, chunk_size=64, max_model_len=64,
              **FIXED_THREADS)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate(["hello", "hi", "word " * 80], SamplingParams(max_tokens=4))
    assert all_blocks_free(llm)
    (output,) = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=4))
    assert len(output.token_ids) >= 1


@pytest.mark.parametrize(
    "params,field",
    [
        (SamplingParams(logit_bias={49152: 5.0}), "logit_bias"),
        (SamplingParams(stop_token_ids=[10**6]), "stop_token_ids"),
    ],
)
def test_sampling_token_ids_outside_the_vocabulary_are_refused(llm, params, field):
    with pytest.raises(InvalidInputError, match=rf"^{field}: .*the vocabulary has 49152 tokens") as raised:
        llm.generate(["hello", "hi"], [SamplingParams(max_tokens=2), params])
    assert raised.value.field == field
    assert all_blocks_free(llm)


def test_out_of_vocabulary_token_ids(llm):
    with pytest.raises(ValueError, match=r"prompt_token_ids: 49152 is not a token id in \[0, 49152\)"):
        llm.generate(prompt_token_ids=[[1, 2, 49152]])
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate(prompt_token_ids=[[-1]])
    assert all_blocks_free(llm)


def test_unknown_model_path():
    with pytest.raises(ValueError, match="^model: no such file or folder"):
        LLM("/nonexistent/model.gguf")


def test_file_that_is_not_gguf(tmp_path):
    path = tmp_path / "notes.gguf"
    path.write_text("this is not a model")
    with pytest.raises(ValueError, match="^model: .* is not a GGUF file"):
        LLM(str(path))


def test_folder_without_config(tmp_path):
    with pytest.raises(ValueError, match="has no config.json"):
        LLM(str(tmp_path))


def test_truncated_gguf(model_path, tmp_path):
    truncated = tmp_path / "truncated.gguf"
    with open(model_path, "rb") as source:
        truncated.write_bytes(source.read(os.path.getsize(model_path) // 2))
    with pytest.raises(ValueError, match="^model: .*(truncated|corrupt)"):
        LLM(str(truncated))


def test_corrupt_gguf_header(model_path, tmp_path):
    corrupt = tmp_path / "corrupt.gguf"
    with open(model_path, "rb") as source:
        data = bytearray(source.read(1 << 16))
    data[8:16] = b"\xff" * 8  # an absurd tensor count
    corrupt.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="^model: .*(truncated|corrupt)"):
        LLM(str(corrupt))


def test_unsupported_architecture_is_named(tmp_path):
    import gguf

    path = tmp_path / "falcon.gguf"
    writer = gguf.GGUFWriter(str(path), "falcon")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="architecture 'falcon'"):
        LLM(str(path))


@pytest.mark.parametrize(
    "build,field",
    [
        (lambda: CacheConfig(block_size=0), "block_size"),
        (lambda: CacheConfig(kv_cache_memory_fraction=1.5), "kv_cache_memory_fraction"),
        (lambda: SchedulerConfig(max_num_seqs=0), "max_num_seqs"),
        (lambda: ChunkedPrefillConfig(chunk_size=0), "chunk_size"),
        (lambda: ChunkedPrefillConfig(chunk_size="big"), "chunk_size"),
        (lambda: EngineConfig.from_kwargs(dtype="int3"), "dtype"),
        (lambda: EngineConfig.from_kwargs(bogus_option=1), "unknown engine option"),
    ],
)
def test_engine_options_name_the_field(build, field):
    with pytest.raises(ValueError, match=field):
        build()


def _float_options() -> list[str]:
    return [
        flat_name(section, config_field.name)
        for section, section_cls in SUBCONFIGS.items()
        for config_field in dataclasses.fields(section_cls)
        if "float" in str(config_field.type)
    ]


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, 1e308])
@pytest.mark.parametrize("name", _float_options())
def test_every_float_engine_option_is_finite_and_bounded(name, value):
    with pytest.raises(InvalidInputError, match=f"^{name}: must be a finite number") as error:
        EngineConfig.from_kwargs(**{name: value})
    assert error.value.field == name


@pytest.mark.parametrize(
    "name,value,limit",
    [
        ("ttft_slo_ms", 86_400_001, "(0, 86400000]"),  # as a request's own ttft_slo_ms
        ("max_queue_wait_s", 86_401, "(0, 86400]"),
        ("distributed_timeout_s", 86_401, "(0, 86400]"),
        ("itl_target_ms", 86_400_001, "(0, 86400000]"),
        ("seed", 2**64, "[-9223372036854775808, 18446744073709551615]"),
    ],
)
def test_engine_options_past_their_limit_state_it(name, value, limit):
    with pytest.raises(InvalidInputError, match=re.escape(f"{name}: must be")) as error:
        EngineConfig.from_kwargs(**{name: value})
    assert limit in str(error.value)


def test_refuse_without_anything_to_predict_is_refused_at_start():
    with pytest.raises(InvalidInputError, match="^slo_policy: 'refuse'.*set ttft_slo_ms"):
        EngineConfig.from_kwargs(slo_policy="refuse", chunk_size=64)
    with pytest.raises(InvalidInputError, match="^slo_policy"):
        EngineConfig.from_kwargs(slo_policy="refuse", enable_chunked_prefill=False)
    # An objective to predict against: the engine's, or (auto's cost model) each request's own.
    assert EngineConfig.from_kwargs(slo_policy="refuse", chunk_size=64, ttft_slo_ms=500).predicts_ttft
    assert EngineConfig.from_kwargs(slo_policy="refuse").predicts_ttft
