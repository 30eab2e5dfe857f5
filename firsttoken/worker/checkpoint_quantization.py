"""The quantization a checkpoint runs under, resolved into the engine's config once.

A W8A8 checkpoint (compressed-tensors) turns an unset `quantization` into "w8a8" where this
device sums int8 exactly. The engine resolves its config here before it builds any worker, so
the engine core, every tensor-parallel rank and the engine's inspection all read one config;
a worker only checks that the config it is handed is the resolved one.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from firsttoken.config import EngineConfig, ModelConfig
from firsttoken.errors import InvalidInputError
from firsttoken.models.loaders.checkpoint import Checkpoint
from firsttoken.models.loaders.conversion_cache import default_cache_dir
from firsttoken.models.registry import open_checkpoint, resolve_model_path
from firsttoken.ops.w8a8 import w8a8_unsupported_reason
from firsttoken.worker.device import resolve_device

logger = logging.getLogger(__name__)


def resolve_checkpoint_quantization(config: EngineConfig) -> EngineConfig:
    """`config` with the quantization its checkpoint runs under on its device: a W8A8 one as
    W8A8 on its own levels where `quantization` is unset and oneDNN sums int8 exactly (VNNI,
    AMX-INT8), else on their dequantized float weights, with a warning (float32 is faster there
    than the native exact int8 matmul, which `quantization="w8a8"` asks for explicitly)."""
    model_config = config.model_config
    cache_dir = model_config.cache_dir or default_cache_dir()
    checkpoint = open_checkpoint(resolve_model_path(model_config.model), cache_dir)
    device = resolve_device(model_config.device)
    quantization = _quantization_here(model_config, checkpoint, device)
    if checkpoint.quantization == "w8a8" and quantization is None:
        logger.warning(
            "%s is a W8A8 checkpoint; running its dequantized weights: %s",
            checkpoint.source,
            w8a8_unsupported_reason(device),
        )
    if quantization == model_config.quantization:
        return config
    return replace(config, model_config=replace(model_config, quantization=quantization))


def check_checkpoint_quantization(config: EngineConfig, checkpoint: Checkpoint, device: torch.device) -> None:
    """Raises where `config` is not what resolve_checkpoint_quantization makes of it for this
    checkpoint on this device: a worker runs the engine's config as given, so one that
    disagrees with the checkpoint would run the model otherwise than the engine reports."""
    given = config.model_config.quantization
    resolved = _quantization_here(config.model_config, checkpoint, device)
    if given != resolved:
        raise InvalidInputError(
            "quantization",
            f"{checkpoint.source} runs as {resolved!r} on {device.type}, but the worker was handed "
            f"{given!r}: the engine resolves its config (resolve_checkpoint_quantization) before "
            "it builds any worker",
        )


def _quantization_here(model_config: ModelConfig, checkpoint: Checkpoint, device: torch.device) -> str | None:
    """The quantization `checkpoint` runs under on `device` with these options; options a W8A8
    checkpoint cannot take are refused naming their field."""
    if checkpoint.quantization != "w8a8":
        return model_config.quantization
    _refuse_options_of_float_checkpoints(model_config, checkpoint)
    if model_config.quantization is None and w8a8_unsupported_reason(device) is not None:
        return None
    return "w8a8"


def _refuse_options_of_float_checkpoints(model_config: ModelConfig, checkpoint: Checkpoint) -> None:
    """A W8A8 checkpoint's levels are fixed: another quantization, smoothing or rotation of
    them cannot apply."""
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
    if model_config.w8a8_rotation:
        raise InvalidInputError(
            "w8a8_rotation", f"{checkpoint.source} is quantized already: its levels cannot turn"
        )
