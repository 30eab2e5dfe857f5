"""Kernels: per call, a fused op or its plain reference.

- On CPUs with a C compiler, the hand-written kernels of `native`: one ctypes call, one pass
  over memory, on torch's OpenMP threads once a step is large. They beat both alternatives
  at every size measured (bf16, 64 to 2048 rows; see `NativeKernels`).
- On CUDA, the Triton kernels of `triton_ops`: one launch per op at every size, where a
  reference takes several (a prefill's time on a GPU is mostly the host's launches).
- Otherwise (no compiler, or triton missing), from `FUSED_MIN_TOKENS` rows the reference
  functions compiled by inductor: one pass over memory instead of one per elementwise op. A
  compiled call costs tens of microseconds to dispatch, more than it saves on fewer rows.
- Where neither applies (a dtype or layout the native kernels do not take, short steps
  without them) the reference runs; compilation happens only at start-up (`warm_up`).
"""

from __future__ import annotations

import functools
import logging
from types import ModuleType

import torch

from firsttoken.ops import native, native_library
from firsttoken.ops.activation import gelu_tanh_and_mul_reference, silu_and_mul_reference
from firsttoken.ops.norm import add_rms_norm_reference, rms_norm_reference
from firsttoken.ops.rotary import apply_rotary_reference

logger = logging.getLogger(__name__)

# Below this many tokens a compiled call's dispatch (guards, wrapper) costs more than the
# memory passes it saves: norm + SwiGLU + rotary of one layer in bf16 measured 654 us eager vs
# 712 us compiled at 256 tokens, 1292 vs 1127 us at 512.
FUSED_MIN_TOKENS = 512
# Round where the reference rounds (bf16 intermediates), so fused and reference agree closely.
_COMPILE_OPTIONS = {"emulate_precision_casts": True}


def _compiled(function):
    """`function` compiled by inductor on its first call: `torch.compile` imports torch._dynamo
    (seconds of every process's start), which only engines without native or Triton kernels use."""
    compiled = None

    @functools.wraps(function)
    def call(*args):
        nonlocal compiled
        if compiled is None:
            compiled = torch.compile(function, dynamic=True, fullgraph=True, options=_COMPILE_OPTIONS)
        return compiled(*args)

    return call


_fused_rms_norm = _compiled(rms_norm_reference)
_fused_add_rms_norm = _compiled(add_rms_norm_reference)
_fused_silu_and_mul = _compiled(silu_and_mul_reference)
_fused_gelu_tanh_and_mul = _compiled(gelu_tanh_and_mul_reference)
_fused_apply_rotary = _compiled(apply_rotary_reference)


class Kernels:
    """Owns one model's choice between fused and reference ops."""

    def __init__(
        self,
        fused: bool,
        native_kernels: native.NativeKernels | None = None,
        triton_ops: ModuleType | None = None,
    ) -> None:
        self.fused = fused
        self.native = native_kernels if fused else None
        self.triton = triton_ops if fused else None  # firsttoken.ops.triton_ops, imported on CUDA only

    def _use_compiled(self, x: torch.Tensor) -> bool:
        return self.fused and self.native is None and self.triton is None and x.shape[0] >= FUSED_MIN_TOKENS

    def _use_triton(self, x: torch.Tensor) -> bool:
        return self.triton is not None and x.stride(-1) == 1

    def _use_native(self, x: torch.Tensor) -> bool:
        return self.native is not None and native_library.supports(x)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if self._use_native(x) and x.is_contiguous() and weight.dtype == x.dtype:
            return self.native.rows.rms_norm(x, weight, eps)
        if self._use_triton(x):
            return self.triton.rms_norm(x, weight, eps)
        if self._use_compiled(x):
            return _fused_rms_norm(x, weight, eps)
        return rms_norm_reference(x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._use_native(x) and x.is_contiguous() and residual.is_contiguous() and weight.dtype == x.dtype:
            return self.native.rows.add_rms_norm(x, residual, weight, eps)
        if self._use_triton(x) and residual.stride(-1) == 1:
            return self.triton.add_rms_norm(x, residual, weight, eps)
        if self._use_compiled(x):
            return _fused_add_rms_norm(x, residual, weight, eps)
        return add_rms_norm_reference(x, residual, weight, eps)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self._use_native(gate_up) and gate_up.is_contiguous():
            return self.native.rows.silu_and_mul(gate_up)
        if self._use_triton(gate_up):
            return self.triton.silu_and_mul(gate_up)
        if self._use_compiled(gate_up):
            return _fused_silu_and_mul(gate_up)
        return silu_and_mul_reference(gate_up)

    def gelu_tanh_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """GeGLU (Gemma): no native or Triton kernel, compiled on long steps where nothing else is."""
        if self._use_compiled(gate_up):
            return _fused_gelu_tanh_and_mul(gate_up)
        return gelu_tanh_and_mul_reference(gate_up)

    def apply_rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, heads, head_dim] rotated; the native kernel rotates x in place."""
        if (
            self._use_native(x)
            and native_library.heads_contiguous(x)
            and cos.is_contiguous()
            and cos.dtype == x.dtype
        ):
            return self.native.rows.apply_rotary_(x, cos, sin)
        if self._use_triton(x) and cos.stride(-1) == 1 and sin.stride(-1) == 1:
            return self.triton.apply_rotary_(x, cos, sin)
        if self._use_compiled(x):
            return _fused_apply_rotary(x, cos, sin)
        return apply_rotary_reference(x, cos, sin)

    def warm_up(self, run_model_step) -> None:
        """Compile the fused ops by running a step of `FUSED_MIN_TOKENS` tokens (nothing to
        compile where the native kernels serve); if this machine cannot compile (no C++
        compiler), fall back to the reference ops."""
        if not self.fused or self.native is not None or self.triton is not None:
            return
        try:
            run_model_step(FUSED_MIN_TOKENS)
        except Exception as error:  # inductor raises many kinds when a toolchain is missing
            logger.warning("fused ops unavailable, using the reference ops (%s)", error)
            self.fused = False
