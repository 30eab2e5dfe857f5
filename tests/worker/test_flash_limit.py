"""The measured limit between the native prefill attention and SDPA: the rule on fake timings,
its cache, and the measurement itself on this machine (no wall-clock asserts)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from firsttoken.worker import flash_limit
from firsttoken.worker.flash_limit import (
    AttentionShape,
    FlashLimit,
    LengthTiming,
    decide_limit,
    load_or_measure_limit,
)


def _timings(*pairs: tuple[int, float, float]) -> list[LengthTiming]:
    return [LengthTiming(queries, flash_s, sdpa_s) for queries, flash_s, sdpa_s in pairs]


def test_the_native_kernel_keeps_every_length_it_wins_at_all_of():
    limit = decide_limit(_timings((512, 0.002, 0.004), (1024, 0.009, 0.012), (2048, 0.036, 0.041)))
    assert limit.max_queries is None
    assert "every prompt on the native kernel" in limit.reason and "2048: 36.0 vs 41.0 ms" in limit.reason


def test_the_limit_is_the_longest_length_won_with_every_shorter_one():
    assert decide_limit(_timings((512, 1, 2), (1024, 3, 4), (2048, 9, 8))).max_queries == 1024
    # A win past a loss does not count: the limit is one length, not a set of them.
    assert decide_limit(_timings((512, 1, 2), (1024, 5, 4), (2048, 7, 8))).max_queries == 512


def test_a_loss_at_the_shortest_length_sends_every_prompt_to_sdpa():
    limit = decide_limit(_timings((2048, 9, 8), (512, 2, 1)))
    assert limit.max_queries == 0 and "every prompt on SDPA" in limit.reason
    assert [timing.queries for timing in limit.timings] == [512, 2048]


def test_a_tie_keeps_the_native_kernel():
    assert decide_limit(_timings((512, 1, 1))).max_queries is None


def test_a_limit_survives_its_json_form():
    limit = decide_limit(_timings((512, 1, 2), (1024, 5, 4)))
    assert FlashLimit.from_json(limit.to_json()) == limit


@pytest.fixture
def float32_flash_kernels(native_kernels):
    probe = torch.empty(1, 9, 64)
    if native_kernels is None or not native_kernels.flash.flash_attention_supports(probe, probe):
        pytest.skip("no native flash kernel here")
    return native_kernels


def test_the_limit_is_measured_once_then_read_from_the_cache(tmp_path, float32_flash_kernels, monkeypatch):
    measured = []

    def fake_lengths(*args, **kwargs):
        measured.append(args[1:])
        return _timings((512, 1, 2), (1024, 5, 4))

    monkeypatch.setattr(flash_limit, "measure_lengths", fake_lengths)
    shape = AttentionShape(9, 3, 64, torch.float32)
    first = load_or_measure_limit(str(tmp_path), float32_flash_kernels, shape, 2)
    again = load_or_measure_limit(str(tmp_path), float32_flash_kernels, shape, 2)
    assert first == again and first.max_queries == 512 and len(measured) == 1
    load_or_measure_limit(str(tmp_path), float32_flash_kernels, AttentionShape(8, 2, 64, torch.float32), 2)
    load_or_measure_limit(str(tmp_path), float32_flash_kernels, shape, 1)
    assert len(measured) == 3


def test_a_damaged_cache_file_is_measured_again(tmp_path, float32_flash_kernels, monkeypatch):
    monkeypatch.setattr(flash_limit, "measure_lengths", lambda *args, **kwargs: _timings((512, 1, 2)))
    shape = AttentionShape(9, 3, 64, torch.float32)
    key = flash_limit.flash_limit_key(float32_flash_kernels, shape, 2)
    path = tmp_path / "flash_limit" / key.file_name()
    path.parent.mkdir()
    path.write_text("{not json")
    limit = load_or_measure_limit(str(tmp_path), float32_flash_kernels, shape, 2)
    assert limit.max_queries is None
    assert FlashLimit.from_json(json.loads(path.read_text())["choice"]) == limit


def test_both_kernels_are_timed_at_each_length(float32_flash_kernels):
    shape = AttentionShape(4, 2, 64, torch.float32)
    timings = flash_limit.measure_lengths(float32_flash_kernels, shape, 1, lengths=(16, 64))
    assert [timing.queries for timing in timings] == [16, 64]
    for timing in timings:
        assert math.isfinite(timing.flash_s) and timing.flash_s > 0
        assert math.isfinite(timing.sdpa_s) and timing.sdpa_s > 0
