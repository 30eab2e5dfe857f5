"""QuaRot's rotations (Ashkboos et al., 2024): a Llama-family model turned so that its
activations quantize per token with little error, computing the same function, with no
calibration.

A few channels of the residual stream carry values far larger than the rest, and with one int8
scale per token they leave the others few levels. An orthogonal matrix Q spreads each such channel
over all of them, and the model computes the same with its residual stream turned by Q: RMSNorm
commutes with Q (rms(hQ) = rms(h)) once its weight g moves into the projections that read its
output, so the embedding becomes E Q, each projection reading the stream W diag(g) Q, each
projection writing to it Q^T W, and the LM head W diag(g) Q. That is folded into the weights once,
at load: nothing runs for it per token. o_proj's inputs (the heads' attention outputs) turn by one
orthogonal matrix per head, folded into the values' rows and o_proj's columns. down_proj's inputs
come out of SwiGLU, where no fold reaches: they turn at run time by a Walsh-Hadamard transform in
blocks (`firsttoken.ops.hadamard`, nine additions per input in blocks of 512, inside the
quantization pass), whose inverse is folded into down_proj's weights.

On SmolLM2-135M in W8A8, teacher-forced top-1 agreement with float32 over 4096 tokens of the
GPL-3 went from 0.888 (unsmoothed) and 0.933 (smoothed, calibrated) to 0.954, perplexity +0.2%
(`benchmarks/w8a8.py`).
"""

from __future__ import annotations

import torch
from torch import nn

from firsttoken.models.llama import LlamaForCausalLM, layer_projections
from firsttoken.ops.hadamard import BlockHadamard, HadamardInputs
from firsttoken.ops.linear import Linear

ROTATION_SEED = 0


def random_orthogonal(size: int, generator: torch.Generator) -> torch.Tensor:
    """A random orthogonal matrix, uniform over the orthogonal group: QR of a Gaussian one, with
    R's signs moved into Q. float64."""
    q, r = torch.linalg.qr(torch.randn(size, size, generator=generator, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r))


def rotation_unsupported_reason(model: LlamaForCausalLM) -> str | None:
    """Why `model` cannot be rotated (None where it can)."""
    if model.tensor_shard is not None:
        return "a tensor-parallel slice holds part of each rotation's inputs"
    first_layer = model.layers[0]
    if first_layer.attention_output_norm_weight is not None:
        return "norms after the attention and the MLP (Gemma 2 and 3) do not commute with a rotation"
    if any(module.checkpoint_int8 is not None for module in model.modules() if isinstance(module, Linear)):
        return "a W8A8 checkpoint's levels are fixed: its weights cannot turn"
    return None


def rotate_model(model: LlamaForCausalLM) -> None:
    """Turns `model`'s residual stream, each head's values and down_proj's inputs (see the module
    docstring), in place, with new tensors (the loaded ones may be shared); the norms' weights
    become ones and a tied LM head is untied. The caller checks `rotation_unsupported_reason`."""
    arch = model.arch
    generator = torch.Generator().manual_seed(ROTATION_SEED)
    residual = random_orthogonal(arch.hidden_size, generator)
    per_head = random_orthogonal(arch.head_dim, generator)
    hadamard = BlockHadamard(arch.intermediate_size)
    model.embed_weight = _parameter(model.embed_weight.double() @ residual, model.embed_weight.dtype)
    model.lm_head = _linear(_read_stream(model.lm_head.weight, model.norm_weight, residual), None)
    model.norm_weight = _ones_like(model.norm_weight)
    for name, owner, attribute in layer_projections(model.layers):
        layer = model.layers[int(name.split(".")[1])]
        linear = getattr(owner, attribute)
        if attribute == "qkv_proj":
            weight = _read_stream(linear.weight, layer.input_norm_weight, residual)
            setattr(owner, attribute, _turn_values(linear, weight, per_head, owner))
            layer.input_norm_weight = _ones_like(layer.input_norm_weight)
        elif attribute == "gate_up_proj":
            weight = _read_stream(linear.weight, layer.post_attention_norm_weight, residual)
            setattr(owner, attribute, _linear(weight, linear.bias))
            layer.post_attention_norm_weight = _ones_like(layer.post_attention_norm_weight)
        elif attribute == "o_proj":
            heads_turned = torch.block_diag(*[per_head] * arch.num_heads)
            setattr(owner, attribute, _write_stream(linear, linear.weight.double() @ heads_turned, residual))
        else:
            turned = _write_stream(linear, linear.weight.double() @ hadamard.matrix(), residual)
            setattr(owner, attribute, HadamardInputs(hadamard, turned))


def _read_stream(weight: torch.Tensor, norm_weight: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """A projection reading the turned stream after a norm: W diag(g) Q, in the weight's dtype."""
    return ((weight.double() * norm_weight.double()) @ residual).to(weight.dtype)


def _write_stream(linear: nn.Module, weight: torch.Tensor, residual: torch.Tensor) -> Linear:
    """A projection writing to the turned stream: Q^T W (and its bias b Q)."""
    bias = linear.bias
    turned_bias = (bias.double() @ residual).to(bias.dtype) if bias is not None else None
    return _linear((residual.t() @ weight).to(linear.weight.dtype), turned_bias)


def _turn_values(
    linear: nn.Module, weight: torch.Tensor, per_head: torch.Tensor, attention: nn.Module
) -> Linear:
    """q|k|v with each value head's rows (and bias) turned: v' = R^T v, which o_proj's columns
    turn back."""
    value_start = attention.q_size + attention.kv_size
    heads = torch.block_diag(*[per_head] * attention.num_kv_heads)
    weight = weight.clone()
    weight[value_start:] = (heads.t() @ weight[value_start:].double()).to(weight.dtype)
    bias = linear.bias
    if bias is not None:
        bias = bias.detach().clone()
        bias[value_start:] = (heads.t() @ bias[value_start:].double()).to(bias.dtype)
    return _linear(weight, bias)


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
    out_features, in_features = weight.shape
    linear = Linear(in_features, out_features, bias is not None, weight.dtype).to(weight.device)
    linear.weight = _parameter(weight, weight.dtype)
    if bias is not None:
        linear.bias = _parameter(bias, bias.dtype)
    return linear


def _parameter(values: torch.Tensor, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(values.detach().to(dtype).contiguous(), requires_grad=False)


def _ones_like(norm_weight: torch.Tensor) -> nn.Parameter:
    return _parameter(torch.ones_like(norm_weight), norm_weight.dtype)
