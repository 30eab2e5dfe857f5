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
blocks (`firsttoken.ops.hadamard`: log2(block) additions per input, inside the quantization
pass), whose inverse is folded into down_proj's weights.

On SmolLM2-135M in W8A8, teacher-forced top-1 agreement with float32 over 4096 tokens of the
GPL-3 went from 0.888 (unsmoothed) and 0.933 (smoothed, calibrated) to 0.956, perplexity +0.3%
(`benchmarks/w8a8.py`).
"""

from __future__ import annotations

import torch
from torch import nn

from firsttoken.models.llama import LlamaForCausalLM, layer_projections
from firsttoken.models.loaders.conversion_cache import ConversionCache
from firsttoken.ops.hadamard import BlockHadamard, HadamardInputs, walsh_hadamard
from firsttoken.ops.linear import Linear

ROTATION_SEED = 0
# Bump when `turned_weights`' names or arithmetic change, so stale cached weights are never read.
ROTATION_FORMAT = 1


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
    docstring), in place: `install_turned_weights` of its `turned_weights`. The caller checks
    `rotation_unsupported_reason`."""
    install_turned_weights(model, turned_weights(model))


def rotate_model_cached(model: LlamaForCausalLM, fingerprint: str, cache_dir: str | None) -> bool:
    """`rotate_model`, its turned weights read from the conversion cache where a start of the same
    checkpoint (its `fingerprint`) in the same dtype wrote them, else turned and written there:
    the float64 products take seconds (2.3 s for SmolLM2-135M on 2 cores), reading them back a
    fraction of that. Returns whether they came from the cache."""
    # What the turned values depend on beyond the checkpoint and this file's arithmetic: the
    # Hadamard block (hadamard.py's rule) and torch's QR (the random rotations).
    block = BlockHadamard(model.arch.intermediate_size).block
    key = f"{fingerprint}-quarot{ROTATION_SEED}-r{ROTATION_FORMAT}-h{block}-torch{torch.__version__}"
    cache = ConversionCache(cache_dir, key)
    dtype = model.embed_weight.dtype
    with cache.converting():
        weights = cache.load_weights(dtype)
        cached = weights is not None and _layouts(weights) == _turned_weight_layouts(model)
        if not cached:
            weights = turned_weights(model)
            cache.save_weights(dtype, {name: tensor.cpu() for name, tensor in weights.items()})
    install_turned_weights(model, weights)
    return cached


def _turned_weight_layouts(model: LlamaForCausalLM) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """The name, shape and dtype `turned_weights` gives each of `model`'s tensors (the turn keeps
    each weight's shape and dtype)."""
    tensors = {"lm_head.weight": model.lm_head.weight, "embed_weight": model.embed_weight}
    for name, owner, attribute in layer_projections(model.layers):
        linear = getattr(owner, attribute)
        tensors[f"{name}.weight"] = linear.weight
        if linear.bias is not None:
            tensors[f"{name}.bias"] = linear.bias
    return _layouts(tensors)


def _layouts(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Size, torch.dtype]]:
    return {name: (tensor.shape, tensor.dtype) for name, tensor in tensors.items()}


def turned_weights(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """The turned model's weights by name ("lm_head.weight", "embed_weight", each layer
    projection's "layers.{i}.{attribute}.weight" and ".bias" where it has one), new tensors in the
    model's dtypes, each turned in float64 and rounded once; `model` is left as it is."""
    arch = model.arch
    generator = torch.Generator().manual_seed(ROTATION_SEED)
    residual = random_orthogonal(arch.hidden_size, generator)
    per_head = random_orthogonal(arch.head_dim, generator)
    hadamard = BlockHadamard(arch.intermediate_size)
    head_norm = model.norm_weight.double()
    weights = {
        "lm_head.weight": _turned_rows(model.lm_head.weight, lambda rows: rows * head_norm @ residual),
        "embed_weight": _turned_rows(model.embed_weight, lambda rows: rows @ residual),
    }
    for name, owner, attribute in layer_projections(model.layers):
        layer = model.layers[int(name.split(".")[1])]
        linear = getattr(owner, attribute)
        if attribute == "qkv_proj":
            weight, bias = _turned_qkv(linear, layer.input_norm_weight, residual, per_head, owner)
        elif attribute == "gate_up_proj":
            norm = layer.post_attention_norm_weight.double()
            weight = _turned_rows(linear.weight, lambda rows, norm=norm: rows * norm @ residual)
            bias = linear.bias
        elif attribute == "o_proj":
            weight, bias = _write_stream(linear, residual, per_head)
        else:
            weight, bias = _write_stream(linear, residual, walsh_hadamard(hadamard.block))
        weights[f"{name}.weight"] = weight
        if bias is not None:
            weights[f"{name}.bias"] = bias.detach().clone()
    return weights


def install_turned_weights(model: LlamaForCausalLM, weights: dict[str, torch.Tensor]) -> None:
    """Puts `turned_weights`' tensors (computed here or read back from a cache) into `model`, in
    place, with new modules: the norms' weights become ones, a tied LM head is untied and
    down_proj reads its inputs through their Hadamard transform."""
    device = model.embed_weight.device
    turned = {name: tensor.to(device) for name, tensor in weights.items()}
    model.lm_head = _linear(turned["lm_head.weight"], None)
    model.embed_weight = _parameter(turned["embed_weight"])
    model.norm_weight = _ones_like(model.norm_weight)
    hadamard = BlockHadamard(model.arch.intermediate_size)
    for name, owner, attribute in layer_projections(model.layers):
        layer = model.layers[int(name.split(".")[1])]
        linear = _linear(turned[f"{name}.weight"], turned.get(f"{name}.bias"))
        if attribute == "down_proj":
            linear = HadamardInputs(hadamard, linear)
        setattr(owner, attribute, linear)
    for layer in model.layers:
        layer.input_norm_weight = _ones_like(layer.input_norm_weight)
        layer.post_attention_norm_weight = _ones_like(layer.post_attention_norm_weight)


# Rows of a large weight (an embedding, an LM head, gate|up) turned at a time: a float64 copy of
# a whole 128k-token embedding would take 4 GiB per thousand columns.
ROWS_PER_CHUNK = 8192


def _turned_rows(weight: torch.Tensor, turn) -> torch.Tensor:
    """`turn` (float64 rows -> float64 rows) over `weight`'s rows, chunk by chunk, in its dtype."""
    turned = torch.empty_like(weight)
    for start in range(0, weight.shape[0], ROWS_PER_CHUNK):
        end = start + ROWS_PER_CHUNK
        turned[start:end] = turn(weight[start:end].detach().double()).to(weight.dtype)
    return turned


def _turned_blocks(weight: torch.Tensor, block_matrix: torch.Tensor) -> torch.Tensor:
    """float64 `weight` [rows, cols] times the block-diagonal matrix with `block_matrix` [b, b]
    down its diagonal, one block of columns at a time."""
    rows, cols = weight.shape
    block = block_matrix.shape[0]
    return (weight.reshape(rows, cols // block, block) @ block_matrix).reshape(rows, cols)


def _write_stream(
    linear: nn.Module, residual: torch.Tensor, input_blocks: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weight and bias of a projection writing to the turned stream, its inputs turned by the
    block-diagonal matrix of `input_blocks` (the heads' rotation, or the Hadamard blocks): Q^T W B
    (and its bias b Q)."""
    weight = _turned_blocks(residual.t() @ linear.weight.detach().double(), input_blocks)
    bias = linear.bias
    turned_bias = (bias.detach().double() @ residual).to(bias.dtype) if bias is not None else None
    return weight.to(linear.weight.dtype), turned_bias


def _turned_qkv(
    linear: nn.Module,
    norm_weight: torch.Tensor,
    residual: torch.Tensor,
    per_head: torch.Tensor,
    attention: nn.Module,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weight and bias of q|k|v reading the turned stream after its norm, W diag(g) Q, with
    each value head's rows (and bias) turned too: v' = R^T v, which o_proj's columns turn back."""
    value_start = attention.q_size + attention.kv_size
    weight = (linear.weight.detach().double() * norm_weight.double()) @ residual
    values = weight[value_start:].reshape(attention.num_kv_heads, attention.head_dim, -1)
    weight[value_start:] = (per_head.t() @ values).reshape(-1, weight.shape[1])
    bias = linear.bias
    if bias is not None:
        bias = bias.detach().double().clone()
        value_bias = bias[value_start:].reshape(attention.num_kv_heads, attention.head_dim, 1)
        bias[value_start:] = (per_head.t() @ value_bias).reshape(-1)
        bias = bias.to(linear.bias.dtype)
    return weight.to(linear.weight.dtype), bias


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
    out_features, in_features = weight.shape
    linear = Linear(in_features, out_features, bias is not None, weight.dtype).to(weight.device)
    linear.weight = _parameter(weight)
    if bias is not None:
        linear.bias = _parameter(bias)
    return linear


def _parameter(values: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(values.detach().contiguous(), requires_grad=False)


def _ones_like(norm_weight: torch.Tensor) -> nn.Parameter:
    return _parameter(torch.ones_like(norm_weight))
