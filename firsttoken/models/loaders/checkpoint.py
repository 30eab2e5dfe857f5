"""Checkpoint: what a loader hands the model builder, whatever the file format."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from firsttoken.models.arch import ModelArch
from firsttoken.tokenizer import Tokenizer

# (Hugging Face tensor name, tensor): float32/float16/bfloat16, or a W8A8 checkpoint's int8 levels
# (`.weight`) and their scales (`.weight_scale`)
NamedTensors = Iterator[tuple[str, torch.Tensor]]


@dataclass
class Checkpoint:
    """A model's hyperparameters, tokenizer, identity and a way to stream its weights.

    Weights use Hugging Face names (`model.layers.0.self_attn.q_proj.weight`) in the
    rotate-half rope layout, whatever layout the file stored them in. `quantization`: "w8a8"
    where the checkpoint stores its projections so (compressed-tensors), None for float weights.
    """

    source: str
    format: str
    arch: ModelArch
    tokenizer: Tokenizer
    fingerprint: str
    num_tensors: int
    read_weights: Callable[[], NamedTensors]
    rope_frequency_divisors: torch.Tensor | None = None
    quantization: str | None = None
