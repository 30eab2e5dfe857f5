"""The largest magnitude each input channel of each layer projection reaches: recorded while a
float model runs a calibration text, saved beside the model, read back to smooth W8A8
projections (`firsttoken.ops.w8a8.SMOOTHING_ALPHA`).

A file holds one float32 vector per projection, named as `layer_projections` names them
(`layers.{i}.{qkv_proj|o_proj|gate_up_proj|down_proj}`).
"""

from __future__ import annotations

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from firsttoken.errors import InvalidInputError
from firsttoken.models.llama import layer_projections


class ActivationMaxima:
    """Records, through forward pre-hooks, each projection's per-channel input maxima over every
    row it sees until `detach`."""

    def __init__(self, layers: nn.ModuleList) -> None:
        self.maxima: dict[str, torch.Tensor] = {}
        self._hooks = [
            getattr(owner, attribute).register_forward_pre_hook(self._recorder(name))
            for name, owner, attribute in layer_projections(layers)
        ]

    def _recorder(self, name: str):
        def record(module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
            x = inputs[0]
            step_max = x.reshape(-1, x.shape[-1]).abs().amax(dim=0).float()
            seen = self.maxima.get(name)
            self.maxima[name] = step_max if seen is None else torch.maximum(seen, step_max)

        return record

    def detach(self) -> dict[str, torch.Tensor]:
        for hook in self._hooks:
            hook.remove()
        return self.maxima


def save_activation_maxima(path: str, maxima: dict[str, torch.Tensor]) -> None:
    save_file({name: values.contiguous() for name, values in maxima.items()}, path)


def load_activation_maxima(path: str, layers: nn.ModuleList) -> dict[str, torch.Tensor]:
    """The file's maxima, checked against the model: one vector per projection, each as long as
    that projection's inputs (a file from another model, or a sharded one, is refused)."""
    try:
        maxima = load_file(path)
    except (OSError, ValueError, SafetensorError) as error:
        raise InvalidInputError("w8a8_activation_stats", f"cannot read {path!r}: {error}") from error
    for name, owner, attribute in layer_projections(layers):
        in_features = getattr(owner, attribute).weight.shape[1]
        values = maxima.get(name)
        if values is None or values.shape != (in_features,):
            found = "missing" if values is None else f"of shape {tuple(values.shape)}"
            raise InvalidInputError(
                "w8a8_activation_stats",
                f"{path!r} does not fit this model: {name} is {found}, the projection takes "
                f"{in_features} inputs",
            )
    return maxima
