"""Loads a worker's model in its fastest form here: the kernels (native CPU, Triton on CUDA, or
fused torch ops), the attention backend, the weights in the engine's dtype, this rank's slice
of them, and the projections in their fastest layout.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from types import ModuleType

import torch

from firsttoken.attention.backend import AttentionBackend
from firsttoken.attention.cpu_backend import FLASH_MAX_QUERIES_BESIDE_SDPA
from firsttoken.attention.selector import select_attention_backend
from firsttoken.config import EngineConfig, ModelConfig
from firsttoken.errors import InvalidInputError
from firsttoken.models.arch import ModelArch
from firsttoken.models.llama import LlamaForCausalLM, every_layer_is_plain
from firsttoken.models.loaders.checkpoint import Checkpoint
from firsttoken.models.registry import build_model, unloaded_model
from firsttoken.models.rotation import rotate_model_cached, rotation_unsupported_reason
from firsttoken.models.sharding import Collectives, ModelShard
from firsttoken.ops.kernels import Kernels
from firsttoken.ops.linear import NativeRowInvariantLinear, onednn_packing_available
from firsttoken.ops.native import NativeKernels, load_native_kernels
from firsttoken.ops.w8a8 import w8a8_on_native_matmul, w8a8_unsupported_reason
from firsttoken.ops.w8a8_linear import W8A8Linear
from firsttoken.worker.activation_stats import load_activation_maxima
from firsttoken.worker.flash_limit import AttentionShape, FlashLimit, load_or_measure_limit
from firsttoken.worker.shared_weights import SHARED_WEIGHTS, PreparedWeights, WeightsForm
from firsttoken.worker.w8a8_weights import load_w8a8_weights

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelPlacement:
    """Where and how a worker's model runs: its device, dtype and batch invariance (the options'
    or, where they leave them to the engine, the measured choice), longest sequence and cache
    folder, and the slice of the model it holds with the collectives joining the slices (None
    with one rank)."""

    device: torch.device
    dtype: torch.dtype
    batch_invariant: bool
    max_model_len: int
    cache_dir: str
    shard: ModelShard | None
    collectives: Collectives | None


@dataclass(frozen=True)
class LoadedModel:
    """The model a worker runs, with its attention backend and kernels, and the prepared
    weights it shares with the other engines of its form in this process (None: its own)."""

    model: LlamaForCausalLM
    backend: AttentionBackend
    kernels: Kernels
    shared_weights: PreparedWeights | None
    flash_limit: FlashLimit | None  # measured here: where fresh prompts' attention moves to SDPA


def load_model(config: EngineConfig, checkpoint: Checkpoint, placement: ModelPlacement) -> LoadedModel:
    """The model's weights in the placement's dtype and slice, then in their fastest layout here."""
    model_config = config.model_config
    device = placement.device
    native_kernels = native_kernels_for(model_config, device, placement.cache_dir)
    if native_kernels is not None:
        logger.info("native CPU kernels built for %s", native_kernels.isa)
    streaming = config.streaming_llm
    _check_streaming_runs_here(streaming.window, native_kernels, checkpoint.arch, device)
    attention_arch = attention_arch_of(checkpoint.arch, placement.shard)
    plain_attention = every_layer_is_plain(
        checkpoint.arch, placement.max_model_len, streaming.window, streaming.sink_tokens
    )
    flash_limit = (
        _measured_flash_limit(native_kernels, attention_arch, placement)
        if plain_attention and not placement.batch_invariant
        else None
    )
    backend = select_attention_backend(
        config.attention,
        device,
        attention_arch.num_heads,
        attention_arch.num_kv_heads,
        native_kernels,
        batch_invariant=placement.batch_invariant,
        plain_attention=plain_attention,
        flash_max_queries=(
            flash_limit.max_queries if flash_limit is not None else FLASH_MAX_QUERIES_BESIDE_SDPA
        ),
    )
    kernels = Kernels(
        fused=model_config.fuse_ops, native_kernels=native_kernels, triton_ops=_triton_ops(device)
    )
    _check_quantization_runs_here(model_config.quantization, device, native_kernels)
    pack_onednn = onednn_packing_available(placement.dtype, device)
    form = _weights_form(config, checkpoint, placement, native_kernels, pack_onednn)
    shared = SHARED_WEIGHTS.find(form) if form is not None else None
    if shared is not None:
        model = unloaded_model(
            checkpoint,
            backend,
            kernels,
            placement.dtype,
            placement.max_model_len,
            streaming.window,
            streaming.sink_tokens,
        )
        shared.lend_to(model)
        # The weights are on the device already; this moves the model's own rotary tables.
        return LoadedModel(model.to(device), backend, kernels, shared, flash_limit)
    model = _prepared_model(config, checkpoint, placement, backend, kernels, pack_onednn)
    prepared = SHARED_WEIGHTS.add(form, model) if form is not None else None
    return LoadedModel(model, backend, kernels, prepared, flash_limit)


def _measured_flash_limit(
    native_kernels: NativeKernels | None, attention_arch: ModelArch, placement: ModelPlacement
) -> FlashLimit | None:
    """Where this machine's fresh prompts attend faster on SDPA than on the portable flash
    kernel, where both can take them: plain layers without invariance on the CPU, in a dtype
    the AVX512-BF16 prefill kernel does not take."""
    dtype = placement.dtype
    if native_kernels is None or (dtype == torch.bfloat16 and native_kernels.attention.has_prefill_attention):
        return None
    head_dim = attention_arch.head_dim
    probe = torch.empty(1, attention_arch.num_heads, head_dim, dtype=dtype)
    if not native_kernels.flash.flash_attention_supports(probe, probe):
        return None
    shape = AttentionShape(attention_arch.num_heads, attention_arch.num_kv_heads, head_dim, dtype)
    return load_or_measure_limit(placement.cache_dir, native_kernels, shape, torch.get_num_threads())


def native_kernels_for(
    model_config: ModelConfig, device: torch.device, cache_dir: str
) -> NativeKernels | None:
    """The native CPU kernels the options ask for, built into the cache on first use; None on
    other devices, where the options turn them off, or where they cannot be built."""
    if not (model_config.fuse_ops and model_config.native_kernels and device.type == "cpu"):
        return None
    return load_native_kernels(os.path.join(cache_dir, "native"), model_config.cpu_isa)


def _prepared_model(
    config: EngineConfig,
    checkpoint: Checkpoint,
    placement: ModelPlacement,
    backend: AttentionBackend,
    kernels: Kernels,
    pack_onednn: bool,
) -> LlamaForCausalLM:
    """The model loaded, sliced to the placement's shard and its projections prepared."""
    model_config = config.model_config
    streaming = config.streaming_llm
    model = build_model(
        checkpoint,
        backend,
        kernels,
        placement.dtype,
        placement.device,
        placement.max_model_len,
        placement.cache_dir,
        streaming.window,
        streaming.sink_tokens,
    )
    if placement.shard is not None and placement.collectives is not None:
        model.shard(placement.shard, placement.collectives)
    if model_config.w8a8_rotation:
        reason = rotation_unsupported_reason(model)
        if reason is not None:
            raise InvalidInputError("w8a8_rotation", reason)
        cached = rotate_model_cached(model, checkpoint.fingerprint, placement.cache_dir)
        logger.info(
            "turned the model by orthogonal rotations for W8A8 (QuaRot)%s",
            ", its turned weights read from the cache" if cached else "",
        )
    activation_maxima = (
        load_activation_maxima(model_config.w8a8_activation_stats, model.layers)
        if model_config.w8a8_activation_stats is not None
        else None
    )
    int8_weights = (
        load_w8a8_weights(model_config.w8a8_weights, model.layers)
        if model_config.w8a8_weights is not None
        else None
    )
    model.prepare_projections(
        model_config.quantization,
        model_config.quantized_prefill,
        pack_onednn,
        batch_invariant=placement.batch_invariant,
        triton_matmuls=placement.device.type == "cuda",
        activation_maxima=activation_maxima,
        int8_weights=int8_weights,
    )
    _log_levels(model)
    _log_w8a8_matmul(model)
    return model


def _log_levels(model: LlamaForCausalLM) -> None:
    """Says how many row-invariant projections read their weights' GGUF levels in decode steps."""
    projections = [module for module in model.modules() if isinstance(module, NativeRowInvariantLinear)]
    with_levels = sum(module.levels is not None for module in projections)
    if with_levels:
        logger.info(
            "float32 decode steps read %d of %d projections as their GGUF levels (the same bits)",
            with_levels,
            len(projections),
        )


def _log_w8a8_matmul(model: LlamaForCausalLM) -> None:
    """Says which int8 matmul W8A8 projections run on: the native one (and on which
    instructions) or oneDNN's."""
    projections = [module for module in model.modules() if isinstance(module, W8A8Linear)]
    if not projections:
        return
    first = projections[0]
    if not first.native_matmul:
        multiplier = "oneDNN's int8 matmul"
    elif first.kernels.w8a8.w8a8_matmul_uses_amx:
        multiplier = "the native int8 matmul on AMX-INT8"
    elif first.kernels.w8a8.w8a8_matmul_uses_vnni:
        multiplier = "the native int8 matmul on AVX512-VNNI"
    else:
        multiplier = "the native int8 matmul on AVX2 (VPMADDWD)"
    logger.info("%d W8A8 projections multiply on %s", len(projections), multiplier)


def _weights_form(
    config: EngineConfig,
    checkpoint: Checkpoint,
    placement: ModelPlacement,
    native_kernels: NativeKernels | None,
    pack_onednn: bool,
) -> WeightsForm | None:
    """The form of the weights this engine prepares; None where they are its own alone (a
    tensor-parallel slice, or from a calibration file that may change between starts)."""
    model_config = config.model_config
    calibrated = model_config.w8a8_activation_stats is not None or model_config.w8a8_weights is not None
    if placement.shard is not None or calibrated:
        return None
    w8a8_native_matmul = model_config.quantization == "w8a8" and w8a8_on_native_matmul(native_kernels)
    return WeightsForm(
        fingerprint=checkpoint.fingerprint,
        dtype=placement.dtype,
        device=placement.device,
        quantization=model_config.quantization,
        quantized_prefill=model_config.quantized_prefill,
        batch_invariant=placement.batch_invariant,
        fuse_ops=model_config.fuse_ops,
        native_isa=native_kernels.isa if native_kernels is not None else None,
        pack_onednn=pack_onednn,
        w8a8_native_matmul=w8a8_native_matmul,
        w8a8_swiglu_product=w8a8_native_matmul and native_kernels.w8a8.w8a8_matmul_makes_swiglu,
        w8a8_rotation=model_config.w8a8_rotation,
    )


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
    if not native_kernels.flash.flash_attention_supports(probe, probe):
        raise InvalidInputError(
            "streaming_window",
            f"StreamingLLM needs a head size of whole vectors of this CPU's kernels, not {arch.head_dim}",
        )


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
