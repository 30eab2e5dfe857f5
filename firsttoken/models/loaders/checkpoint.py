"""Checkpoint: what a loader hands the model builder, whatever the file format."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from firsttoken.models.arch import ModelArch
from firsttoken.tokenizer import Tokenizer

# (Hugging Face tensor name, float32/float16/bfloat16 tensor)
NamedTensors = Iterator[tuple[str, torch.Tensor]]


@dataclass
class Checkpoint:
    """A model's hyperparameters, tokenizer, identity and a way to stream its weights.

    Weights use Hugging Face names (`model.layers.0.self_attn.q_proj.weight`) in the
    rotate-half rope layout, whatever layout the file stored them in.
    """

    source: str
    format: str
    arch: ModelArch
    tokenizer: Tokenizer
    fingerprint: str
    num_tensors: int
    read_weights: Callable[[], NamedTensors]
    rope_frequency_divisors: torch.Tensor | None = None
