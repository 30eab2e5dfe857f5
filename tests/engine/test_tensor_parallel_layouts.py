"""Tensor parallelism on a tiny random model: three ranks on two KV heads (one replicated),
and the splits refused before any rank starts.
Each test starts its own ranks: one tensor-parallel engine runs in a process at a time."""

from __future__ import annotations

import pytest

from firsttoken import LLM, SamplingParams
from firsttoken.config import EngineConfig
from firsttoken.errors import InvalidInputError
from tests.conftest import FIXED_THREADS
from tests.engine.test_tensor_parallel import GREEDY, assert_same_outputs
from tests.models.tiny_models import save_hf_folder, tiny_hf_model
from tests.prompts import SHORT_PROMPTS

OPTIONS = {"dtype": "float32", "kv_cache_memory_bytes": 8 << 20, "chunk_size": 32, **FIXED_THREADS}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    """4 query heads on 2 KV heads: three ranks cannot split them evenly."""
    return save_hf_folder(tiny_hf_model("llama"), str(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="module")
def one_rank(tiny_model) -> LLM:
    return LLM(tiny_model, **OPTIONS)


def test_three_ranks_on_two_kv_heads_replicate_one_and_give_one_ranks_tokens(tiny_model, one_rank):
    three = LLM(tiny_model, tensor_parallel_size=3, **OPTIONS)
    try:
        # Ranks 0 and 1 hold KV head 0 and one query head each; rank 2 holds KV head 1 and two.
        shard = three.core.worker.model.tensor_shard
        assert (shard.head_range, shard.kv_head_range) == ((0, 1), (0, 1))
        assert_same_outputs(three.generate(SHORT_PROMPTS, GREEDY), one_rank.generate(SHORT_PROMPTS, GREEDY))
    finally:
        three.shutdown()


def test_three_ranks_in_bf16_do_not_claim_batch_invariance(tiny_model, caplog):
    """Three partial sums may be added in a size-dependent order: the engine warns, not claims."""
    three = LLM(tiny_model, tensor_parallel_size=3, **(OPTIONS | {"dtype": "bfloat16"}))
    try:
        assert not three.core.worker.batch_invariant
        assert "tensor_parallel_size > 2" in caplog.text
    finally:
        three.shutdown()


def test_more_ranks_than_heads_is_refused_before_any_rank_starts(tiny_model):
    with pytest.raises(
        InvalidInputError, match="tensor_parallel_size: 5 ranks exceed the model's 4 attention heads"
    ):
        LLM(tiny_model, tensor_parallel_size=5, **OPTIONS)


def test_persisted_pins_are_refused_with_ranks(tiny_model, tmp_path):
    with pytest.raises(InvalidInputError, match="prompt_cache_dir"):
        LLM(tiny_model, tensor_parallel_size=2, prompt_cache_dir=str(tmp_path), **OPTIONS)


def test_w8a8_maxima_are_refused_with_ranks(tiny_model, tmp_path):
    stats = str(tmp_path / "maxima.safetensors")
    with pytest.raises(InvalidInputError, match="w8a8_activation_stats: maxima are for a whole model"):
        LLM(tiny_model, tensor_parallel_size=2, quantization="w8a8", w8a8_activation_stats=stats, **OPTIONS)


@pytest.mark.parametrize(
    ("options", "field_name"),
    [
        ({"prompt_cache_dir": "/tmp/pins"}, "prompt_cache_dir"),
        ({"quantization": "w8a8", "w8a8_activation_stats": "maxima.safetensors"}, "w8a8_activation_stats"),
        ({"quantization": "w8a8", "w8a8_rotation": True}, "w8a8_rotation"),
    ],
)
def test_the_config_refuses_what_ranks_cannot_split_before_anything_loads(options, field_name):
    with pytest.raises(InvalidInputError, match=f"^{field_name}: .*tensor_parallel_size"):
        EngineConfig.from_kwargs(tensor_parallel_size=2, **options)
    EngineConfig.from_kwargs(tensor_parallel_size=1, **options)


@pytest.mark.slow
def test_two_ranks_in_bf16_stay_batch_invariant(model_path):
    """Each rank's rows are row-invariant and two partial sums add to the same bits in either
    order: a request's tokens and logprobs alone are those it gets in a batch."""
    two = LLM(
        model_path, dtype="bfloat16", kv_cache_memory_bytes=128 << 20, chunk_size=64, tensor_parallel_size=2,
        batch_invariant=True,
    )
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)
    try:
        if not two.core.worker.batch_invariant:
            pytest.skip("batch invariance is not in effect on this CPU")
        batched = two.generate(SHORT_PROMPTS, params)
        for prompt, output in zip(SHORT_PROMPTS, batched, strict=True):
            (alone,) = two.generate([prompt], params)
            assert alone.token_ids == output.token_ids
            assert [token.logprob for token in alone.logprobs] == [token.logprob for token in output.logprobs]
    finally:
        two.shutdown()
