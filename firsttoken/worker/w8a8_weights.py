"""W8A8 weights rounded offline: the calibration inputs' second moments, recorded while a float
model prefills a text, and the file of int8 levels GPTQ rounds from them
(`firsttoken.ops.gptq`), which a W8A8 engine loads instead of rounding its weights to nearest.

A file holds, per layer projection named as `layer_projections` names it, `{name}.levels` (int8
[out, in]) and `{name}.scales` (float32 [out]), in the basis of the model turned by
`w8a8_rotation`: only a rotated engine loads it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from firsttoken.errors import InvalidInputError
from firsttoken.models.llama import layer_projections
from firsttoken.ops.hadamard import HadamardInputs
from firsttoken.ops.w8a8 import INT8_LEVELS, Int8Weight

logger = logging.getLogger(__name__)

FILE_FORMAT = "firsttoken-w8a8-weights"
FORMAT_VERSION = "1"
# How far a file's dequantized weights may lie from the engine's own float ones (relative
# Frobenius distance, per projection). On SmolLM2-135M GPTQ's levels lie 0.8-1.3% away (rounding
# to nearest: 0.7-0.9%); the same levels lie 100-140% from the unturned weights.
MAX_RELATIVE_DISTANCE = 0.05


def multiplied_projections(layers: nn.ModuleList) -> Iterator[tuple[str, nn.Module]]:
    """(name, module) of each layer projection as it multiplies: a turned model's down_proj is
    the projection behind its Hadamard transform, whose inputs are the turned ones."""
    for name, owner, attribute in layer_projections(layers):
        module = getattr(owner, attribute)
        yield name, module.projection if isinstance(module, HadamardInputs) else module


class InputMoments:
    """Records, through forward pre-hooks on the named projections, the second moments X^T X
    [in, in] (float64) of every input row each sees until `detach`."""

    def __init__(self, layers: nn.ModuleList, names: set[str]) -> None:
        self.moments: dict[str, torch.Tensor] = {}
        self._hooks = [
            module.register_forward_pre_hook(self._recorder(name))
            for name, module in multiplied_projections(layers)
            if name in names
        ]

    def _recorder(self, name: str) -> Callable[[nn.Module, tuple[torch.Tensor, ...]], None]:
        def record(module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
            rows = inputs[0].reshape(-1, inputs[0].shape[-1]).double()
            step_moments = rows.t() @ rows
            seen = self.moments.get(name)
            self.moments[name] = step_moments if seen is None else seen.add_(step_moments)

        return record

    def detach(self) -> dict[str, torch.Tensor]:
        """Stops recording; the moments so far."""
        for hook in self._hooks:
            hook.remove()
        return self.moments


def save_w8a8_weights(
    path: str, weights: dict[str, Int8Weight], method: str, calibration_tokens: int
) -> None:
    """Writes the levels and scales, with how they were rounded."""
    tensors = {}
    for name, weight in weights.items():
        tensors[f"{name}.levels"] = weight.levels.contiguous()
        tensors[f"{name}.scales"] = weight.scales.float().contiguous()
    metadata = {
        "format": FILE_FORMAT,
        "format_version": FORMAT_VERSION,
        "method": method,
        "calibration_tokens": str(calibration_tokens),
    }
    save_file(tensors, path, metadata=metadata)


def load_w8a8_weights(path: str, layers: nn.ModuleList) -> dict[str, Int8Weight]:
    """The file's levels and scales, checked against the (turned) model: one pair per
    projection, of its shape, and dequantized within MAX_RELATIVE_DISTANCE of its float weight
    (a file from another model, or of unturned weights, is refused)."""
    try:
        with safe_open(path, framework="pt") as handle:
            metadata = handle.metadata() or {}
            tensors = {key: handle.get_tensor(key) for key in handle.keys()}
    except (OSError, ValueError, SafetensorError) as error:
        raise InvalidInputError("w8a8_weights", f"cannot read {path!r}: {error}") from error
    if metadata.get("format") != FILE_FORMAT or metadata.get("format_version") != FORMAT_VERSION:
        raise InvalidInputError(
            "w8a8_weights",
            f"{path!r} is not a file of W8A8 weights from `firsttoken quantize --method gptq` "
            f"(format {metadata.get('format')!r}, version {metadata.get('format_version')!r})",
        )
    weights = {}
    for name, module in multiplied_projections(layers):
        float_weight = module.weight.detach()
        weight = _file_weight(path, tensors, name, tuple(float_weight.shape))
        distance = _relative_distance(weight, float_weight)
        # Written so that a NaN distance (NaN or infinite scales) is refused too.
        if not distance <= MAX_RELATIVE_DISTANCE:
            raise InvalidInputError(
                "w8a8_weights",
                f"{path!r} does not fit this model: {name}'s levels lie {distance:.0%} from its "
                f"turned float weights (at most {MAX_RELATIVE_DISTANCE:.0%}): written for another "
                "model, or for another rotation",
            )
        weights[name] = weight
    logger.info(
        "W8A8 weights from %s: rounded by %s over %s calibration tokens",
        path,
        metadata.get("method"),
        metadata.get("calibration_tokens"),
    )
    return weights


def _file_weight(
    path: str, tensors: dict[str, torch.Tensor], name: str, shape: tuple[int, int]
) -> Int8Weight:
    levels, scales = tensors.get(f"{name}.levels"), tensors.get(f"{name}.scales")
    if levels is None or scales is None:
        raise InvalidInputError("w8a8_weights", f"{path!r} does not fit this model: it lacks {name}")
    if tuple(levels.shape) != shape or tuple(scales.shape) != shape[:1] or levels.dtype != torch.int8:
        raise InvalidInputError(
            "w8a8_weights",
            f"{path!r} does not fit this model: {name} holds {levels.dtype} levels of shape "
            f"{tuple(levels.shape)} and scales {tuple(scales.shape)}, the projection is {shape}",
        )
    if int(levels.min()) < -INT8_LEVELS:
        raise InvalidInputError(
            "w8a8_weights",
            f"{path!r}: {name} holds level {int(levels.min())}, below -{INT8_LEVELS} (symmetric int8)",
        )
    return Int8Weight(levels, scales.float())


def _relative_distance(weight: Int8Weight, float_weight: torch.Tensor) -> float:
    reference = float_weight.float()
    return float(
        torch.linalg.norm(weight.dequantized() - reference) / torch.linalg.norm(reference).clamp(min=1e-12)
    )
