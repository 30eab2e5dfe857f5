"""Loads a worker's model in its fastest form here: the kernels (native CPU, Triton on CUDA, or
fused torch ops), the attention backend, the weights in the engine's dtype, this rank's slice
of them, and the projections in their fastest layout.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from types import ModuleType

import torch

from firsttoken.attention.backend import AttentionBackend
from firsttoken.attention.selector import select_attention_backend
from firsttoken.config import EngineConfig
from firsttoken.errors import InvalidInputError
from firsttoken.models.arch import ModelArch
from firsttoken.models.llama import LlamaForCausalLM, every_layer_is_plain
from firsttoken.models.loaders.checkpoint import Checkpoint
from firsttoken.models.registry import build_model
from firsttoken.models.sharding import Collectives, ModelShard
from firsttoken.ops.kernels import Kernels
from firsttoken.ops.linear import onednn_packing_available
from firsttoken.ops.native import NativeKernels, load_native_kernels
from firsttoken.ops.w8a8 import w8a8_unsupported_reason
from firsttoken.worker.activation_stats import load_activation_maxima

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelPlacement:
    """Where and how a worker's model runs: its device, dtype, longest sequence and cache
    folder, and the slice of the model it holds with the collectives joining the slices (None
    with one rank)."""

    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    cache_dir: str
    shard: ModelShard | None
    collectives: Collectives | None


@dataclass(frozen=True)
class LoadedModel:
    """The model a worker runs, with its attention backend and kernels."""

    model: LlamaForCausalLM
    backend: AttentionBackend
    kernels: Kernels


def load_model(config: EngineConfig, checkpoint: Checkpoint, placement: ModelPlacement) -> LoadedModel:
    """The model's weights in the placement's dtype and slice, then in their fastest layout here."""
    model_config = config.model_config
    device = placement.device
    native_kernels = None
    if model_config.fuse_ops and model_config.native_kernels and device.type == "cpu":
        native_folder = os.path.join(placement.cache_dir, "native")
        native_kernels = load_native_kernels(native_folder, model_config.cpu_isa)
        if native_kernels is not None:
            logger.info("native CPU kernels built for %s", native_kernels.isa)
    streaming = config.streaming_llm
    _check_streaming_runs_here(streaming.window, native_kernels, checkpoint.arch, device)
    attention_arch = attention_arch_of(checkpoint.arch, placement.shard)
    backend = select_attention_backend(
        config.attention,
        device,
        attention_arch.num_heads,
        attention_arch.num_kv_heads,
        native_kernels,
        batch_invariant=model_config.batch_invariant,
        plain_attention=every_layer_is_plain(
            checkpoint.arch, placement.max_model_len, streaming.window, streaming.sink_tokens
        ),
    )
    kernels = Kernels(
        fused=model_config.fuse_ops, native_kernels=native_kernels, triton_ops=_triton_ops(device)
    )
    model = build_model(
        checkpoint,
        backend,
        kernels,
        placement.dtype,
        device,
        placement.max_model_len,
        placement.cache_dir,
        streaming.window,
        streaming.sink_tokens,
    )
    if placement.shard is not None and placement.collectives is not None:
        model.shard(placement.shard, placement.collectives)
    _check_quantization_runs_here(model_config.quantization, device, native_kernels)
    activation_maxima = (
        load_activation_maxima(model_config.w8a8_activation_stats, model.layers)
        if model_config.w8a8_activation_stats is not None
        else None
    )
    model.prepare_projections(
        model_config.quantization,
        model_config.quantized_prefill,
        onednn_packing_available(placement.dtype, device),
        batch_invariant=model_config.batch_invariant,
        triton_matmuls=device.type == "cuda",
        activation_maxima=activation_maxima,
    )
    return LoadedModel(model, backend, kernels)


def _check_streaming_runs_here(
    window: int | None, native_kernels: NativeKernels | None, arch: ModelArch, device: torch.device
) -> None:
    """StreamingLLM's sinks run on the CPU's native flash kernel (its torch fallbacks lack them)
    and on cuda's Triton paged kernel."""
    if window is None or device.type == "cuda":
        return
    if native_kernels is None:
        raise InvalidInputError(
            "streaming_window",
            "StreamingLLM runs on the CPU's native kernels (native_kernels on) or on cuda",
        )
    probe = torch.empty(1, arch.num_heads, arch.head_dim)
    if not native_kernels.flash_attention_supports(probe, probe):
        raise InvalidInputError(
            "streaming_window",
            f"StreamingLLM needs a head size of whole vectors of this CPU's kernels, not {arch.head_dim}",
        )


def with_checkpoint_quantization(
    config: EngineConfig, checkpoint: Checkpoint, device: torch.device
) -> EngineConfig:
    """The config a quantized checkpoint runs under: a W8A8 one (compressed-tensors) as W8A8 on
    its own levels where `quantization` is unset and oneDNN sums int8 exactly (VNNI, AMX-INT8),
    else on their dequantized float weights, with a warning (float32 is faster there than the
    native exact int8 matmul, which `quantization="w8a8"` asks for explicitly)."""
    model_config = config.model_config
    if checkpoint.quantization != "w8a8":
        return config
    if model_config.quantization not in (None, "w8a8"):
        raise InvalidInputError(
            "quantization",
            f"{checkpoint.source} is a W8A8 checkpoint: its projections run as 'w8a8' (or unset), "
            f"not {model_config.quantization!r}",
        )
    if model_config.w8a8_activation_stats is not None:
        raise InvalidInputError(
            "w8a8_activation_stats",
            f"{checkpoint.source} is quantized already (smoothed, if at all, when it was made)",
        )
    if model_config.quantization is None:
        reason = w8a8_unsupported_reason(device)
        if reason is not None:
            logger.warning(
                "%s is a W8A8 checkpoint; running its dequantized weights: %s", checkpoint.source, reason
            )
            return config
    return replace(config, model_config=replace(model_config, quantization="w8a8"))


def _check_quantization_runs_here(
    quantization: str | None, device: torch.device, native_kernels: NativeKernels | None
) -> None:
    if quantization == "w8a8":
        reason = w8a8_unsupported_reason(device, native_kernels)
        if reason is not None:
            raise InvalidInputError("quantization", reason)


def attention_arch_of(arch: ModelArch, shard: ModelShard | None) -> ModelArch:
    """The head counts one rank's attention and KV cache are sized by."""
    return shard.attention_arch(arch) if shard is not None else arch


def max_model_len(arch: ModelArch, requested: int | None) -> int:
    """The longest sequence the engine serves: the model's limit, or less when asked (a
    sliding-window model attends within its window at any length, on every backend)."""
    limit = arch.max_position_embeddings
    if requested is not None and requested > limit:
        raise InvalidInputError("max_model_len", f"{requested} exceeds the model's limit of {limit} tokens")
    return requested or limit


def _triton_ops(device: torch.device) -> ModuleType | None:
    """The Triton kernels of the elementwise ops on CUDA; None elsewhere."""
    if device.type != "cuda":
        return None
    # Imported here: triton is needed on CUDA only (where the attention backend needs it too).
    from firsttoken.ops import triton_ops

    return triton_ops
