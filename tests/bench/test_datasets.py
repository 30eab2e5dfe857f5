"""Benchmark prompts: exact token lengths with a tokenizer, the shape of each request set."""

from __future__ import annotations

import pytest

from firsttoken.bench.datasets import DatasetSpec, TextSource, build_prompts
from firsttoken.models.registry import open_checkpoint


@pytest.fixture(scope="module")
def tokenizer(model_path):
    return open_checkpoint(model_path).tokenizer


@pytest.mark.parametrize("num_tokens", [1, 17, 128, 600])
def test_texts_encode_to_the_requested_token_count(tokenizer, num_tokens):
    source = TextSource(tokenizer, seed=num_tokens)
    for _ in range(3):
        assert len(tokenizer.encode(source.text(num_tokens))) == num_tokens


def test_without_a_tokenizer_one_word_stands_for_one_token():
    source = TextSource(None, seed=0)
    text = source.text(50)
    assert len(text.split()) == 50 and source.count(text) == 50


def test_random_prompts_are_fresh_and_reproducible(tokenizer):
    spec = DatasetSpec(name="random", num_prompts=5, input_len=64, output_len=16, range_ratio=0.5, seed=2)
    prompts = build_prompts(spec, tokenizer)
    assert len(prompts) == 5 and len({p.text for p in prompts}) == 5
    assert all(32 <= p.num_prompt_tokens <= 96 and p.max_tokens == 16 for p in prompts)
    assert all(p.num_prompt_tokens == len(tokenizer.encode(p.text)) for p in prompts)
    assert build_prompts(spec, tokenizer) == prompts


def test_shared_prefix_makes_groups_that_share_a_system_prompt(tokenizer):
    spec = DatasetSpec(
        name="shared-prefix", num_prefix_groups=3, prompts_per_group=4, prefix_len=40, input_len=10
    )
    prompts = build_prompts(spec, tokenizer)
    prefixes = [p.text.split("\n")[0] for p in prompts]
    assert len(prompts) == 12 and len(set(prefixes)) == 3
    assert all(prefixes.count(prefix) == 4 for prefix in set(prefixes))
    assert all(len(tokenizer.encode(prefix)) == 40 for prefix in prefixes)
    assert prefixes[:4] != [prefixes[0]] * 4  # the groups interleave


def test_shared_prefix_refuses_a_conflicting_prompt_count():
    with pytest.raises(ValueError, match="num_prompts"):
        DatasetSpec(name="shared-prefix", num_prompts=10, num_prefix_groups=3, prompts_per_group=4)


def test_mixed_long_is_mostly_short_with_occasional_long_prompts():
    spec = DatasetSpec(
        name="mixed-long", num_prompts=200, input_len=20, long_input_len=300, long_fraction=0.1, seed=5
    )
    lengths = [p.num_prompt_tokens for p in build_prompts(spec, None)]
    num_long = sum(1 for length in lengths if length == 300)
    assert 8 <= num_long <= 35 and lengths.count(20) == 200 - num_long
