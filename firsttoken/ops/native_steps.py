"""The whole-step kernels: a decode step of an int4 model (csrc/decode_step.c in bf16,
csrc/portable_decode_step.c in float32) and a W8A8 model's step (csrc/w8a8_step.c), each every
layer in one call. `firsttoken.ops.native_decode` and `firsttoken.ops.native_w8a8_step` lay out
the models and batches they take."""

from __future__ import annotations

import ctypes

import torch

from firsttoken.ops import native_abi
from firsttoken.ops.native_library import NativeLibrary, check


class StepKernels:
    """Runs a model's step, every layer, in one native call."""

    def __init__(self, library: NativeLibrary) -> None:
        self._kernels = library.kernels
        self.has_w8a8_step = "ft_w8a8_step" in self._kernels

    def w8a8_step(
        self,
        model: native_abi.W8A8StepModel,
        batch: native_abi.W8A8StepBatch,
        hidden: torch.Tensor,
        residual: torch.Tensor,
    ) -> None:
        """Runs a W8A8 model's step (see native_w8a8_step.NativeW8A8Step): hidden, contiguous bf16
        [T, hidden_size], the embeddings in and the last layer's output out; residual, likewise,
        the residual after its add out."""
        status = self._kernels["ft_w8a8_step"](
            model=ctypes.byref(model), batch=ctypes.byref(batch), hidden=hidden.data_ptr(),
            residual=residual.data_ptr(), num_threads=torch.get_num_threads(),
        )
        check(
            status,
            out_of_bounds="W8A8 step: a slot, block id or sequence length outside the KV cache",
            bad_shape="W8A8 step: a shape one of its kernels does not take",
        )

    def decode_step(
        self, model: native_abi.DecodeModel, batch: native_abi.DecodeBatch, hidden: torch.Tensor
    ) -> None:
        """Runs the whole-step decode for hidden's dtype (see native_decode.NativeDecodeStep) on
        hidden in place: `ft_decode_step` (bf16, AVX512-BF16 builds) or `ft_portable_decode_step`
        (float32, every build)."""
        name = "ft_decode_step" if hidden.dtype == torch.bfloat16 else "ft_portable_decode_step"
        status = self._kernels[name](
            model=ctypes.byref(model), batch=ctypes.byref(batch), hidden=hidden.data_ptr(),
            num_threads=torch.get_num_threads(),
        )
        check(
            status,
            out_of_bounds=(
                f"decode step: more than {native_abi.DECODE_MAX_ROWS} sequences, or a slot, block id "
                "or sequence length outside the KV cache"
            ),
            bad_shape="decode step: a head size or grouping of heads the attention does not take",
        )
