"""Engines of one model in one process share its prepared weights.

Preparing a model's projections (fusing, packing, quantizing) writes every weight into fresh
memory: ~300 MB to 1 GB for the embedded model by dtype and form, each page of it faulted and
zeroed by the kernel first (where freed memory goes back to a VM's host, each such fault costs
the host's fault too). A second engine of the same checkpoint with weights in the same form -
another `LLM` beside the first, a server's engine beside a batch one, a notebook's restarted
engine while the old one lives - takes the first one's prepared projections and parameters
instead of building its own: steps only read them, so the engines give the tokens each would
alone, and the memory is held once, until the last engine using it is gone.

Each engine keeps its own model object, attention modules, rotary tables and KV cache; what is
shared is the modules of the projections and the LM head and the other parameters (embedding,
norms). A model split over tensor-parallel ranks, or smoothed by activation statistics read from
a file, builds its own.
"""

from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from firsttoken.models.llama import LlamaForCausalLM, layer_projections

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WeightsForm:
    """What a model's prepared weights are a function of: the checkpoint, and how its
    projections were converted and laid out for the kernels that run them."""

    fingerprint: str
    dtype: torch.dtype
    device: torch.device
    quantization: str | None
    quantized_prefill: bool
    batch_invariant: bool
    fuse_ops: bool
    native_isa: str | None
    pack_onednn: bool
    w8a8_native_matmul: bool
    # gate | up packed for the int8 matmul's SwiGLU epilogue (returning the product, not gate | up).
    w8a8_swiglu_product: bool
    w8a8_rotation: bool


class PreparedWeights:
    """A prepared model's projection modules and LM head, and its other parameters, by name."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        self.projections: dict[str, nn.Module] = {
            name: getattr(owner, attribute) for name, owner, attribute in layer_projections(model.layers)
        }
        self.lm_head = model.lm_head
        # With the projections' own (the same objects once they are lent).
        self.parameters: dict[str, nn.Parameter] = dict(model.named_parameters())

    def lend_to(self, model: LlamaForCausalLM) -> None:
        """Make `model` (built, not loaded, from the same checkpoint) compute with these weights."""
        for name, owner, attribute in layer_projections(model.layers):
            setattr(owner, attribute, self.projections[name])
        model.lm_head = self.lm_head
        own_parameters = dict(model.named_parameters())
        for name, parameter in self.parameters.items():
            own = own_parameters.get(name)
            if own is parameter:
                continue
            if own is None or own.shape != parameter.shape or own.dtype != parameter.dtype:
                raise ValueError(f"model: the shared weights' {name} does not fit this model")
            owner_name, _, attribute = name.rpartition(".")
            setattr(model.get_submodule(owner_name), attribute, parameter)


class SharedWeightsRegistry:
    """The prepared weights of the engines alive in this process, by their form: an entry lives
    as long as some engine holds it."""

    def __init__(self) -> None:
        self._prepared: weakref.WeakValueDictionary[WeightsForm, PreparedWeights] = (
            weakref.WeakValueDictionary()
        )
        self._lock = threading.Lock()

    def find(self, form: WeightsForm) -> PreparedWeights | None:
        with self._lock:
            prepared = self._prepared.get(form)
        if prepared is not None:
            logger.info("sharing the prepared weights of another engine in this process")
        return prepared

    def add(self, form: WeightsForm, model: LlamaForCausalLM) -> PreparedWeights:
        """Offer a prepared model's weights to the engines started after it."""
        prepared = PreparedWeights(model)
        with self._lock:
            self._prepared[form] = prepared
        return prepared


SHARED_WEIGHTS = SharedWeightsRegistry()
