"""Greedy sampling's native argmax (`RowKernels.argmax_rows`) against torch.argmax, on every
build this CPU runs (the conftest's `kernels`): the same index, ties and NaNs included."""

from __future__ import annotations

import pytest
import torch

from firsttoken.core.batch import SampleSpec
from firsttoken.sample.sampler import Sampler
from firsttoken.sampling_params import SamplingParams

# Around the kernel's strides: a vector (4, 8 or 16 lanes), four chains of them, and the
# scalar tail past the last whole stride; 49152 is SmolLM2's vocabulary.
ROW_LENGTHS = [1, 3, 15, 16, 17, 63, 64, 65, 127, 129, 1000, 49152]


def _rows(kind: str, rows: int, cols: int, generator: torch.Generator) -> torch.Tensor:
    if kind == "random":
        return torch.randn(rows, cols, generator=generator)
    if kind == "ties":  # few distinct values: the largest repeats across lanes and chains
        return torch.randint(-2, 3, (rows, cols), generator=generator).float()
    return torch.full((rows, cols), float("-inf"))


@pytest.mark.parametrize("cols", ROW_LENGTHS)
@pytest.mark.parametrize("kind", ["random", "ties", "all -inf"])
def test_argmax_rows_gives_torch_argmax_index(kernels, cols, kind):
    logits = _rows(kind, 5, cols, torch.Generator().manual_seed(cols))
    assert kernels.rows.argmax_rows(logits).tolist() == torch.argmax(logits, dim=-1).tolist()


def test_argmax_rows_split_over_threads_gives_each_row_its_own_index(kernels):
    logits = torch.randn(48, 3000, generator=torch.Generator().manual_seed(1))
    logits[7, 2999] = logits[7].max() + 1  # the last column, in the scalar tail
    logits[8, :] = logits[8].max()  # every value tied: the first
    assert kernels.rows.argmax_rows(logits).tolist() == torch.argmax(logits, dim=-1).tolist()


@pytest.mark.parametrize("positions", [[0], [5], [70, 3], [999], [64, 640]])
def test_argmax_rows_takes_the_first_nan_as_torch_does(kernels, positions):
    logits = torch.randn(2, 1000, generator=torch.Generator().manual_seed(2))
    logits[1, positions] = float("nan")
    logits[1, 500] = float("inf")
    assert kernels.rows.argmax_rows(logits).tolist() == torch.argmax(logits, dim=-1).tolist()
    assert kernels.rows.argmax_rows(logits)[1] == min(positions)


def test_argmax_rows_names_what_it_cannot_take(kernels):
    with pytest.raises(ValueError, match="float32"):
        kernels.rows.argmax_rows(torch.zeros(2, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="contiguous"):
        kernels.rows.argmax_rows(torch.zeros(8, 2).t())
    with pytest.raises(ValueError, match="no values"):
        kernels.rows.argmax_rows(torch.zeros(2, 0))


def test_the_sampler_picks_the_same_tokens_on_the_native_argmax(kernels):
    logits = torch.randn(9, 700, generator=torch.Generator().manual_seed(3))
    logits[0, 10:13] = logits[0].max() + 1
    logits[3, 40] = float("nan")
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, logprobs=2),
              SamplingParams(temperature=0.8, seed=5)]
    specs = [SampleSpec(params[row % len(params)], 0, f"r{row}") for row in range(logits.shape[0])]
    native_sampler = Sampler(0, torch.device("cpu"), logits.shape[1], native_kernels=kernels)
    plain_sampler = Sampler(0, torch.device("cpu"), logits.shape[1])
    native_tokens = native_sampler.sample(logits.clone(), specs)
    assert native_tokens == plain_sampler.sample(logits.clone(), specs)
    assert native_tokens[0].token_id == 10 and native_tokens[3].token_id == 40
