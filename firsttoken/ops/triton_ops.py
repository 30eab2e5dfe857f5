"""Triton kernels of the CUDA path's elementwise ops, one launch each where the references take
several: RMSNorm (alone and with the residual add before it), SwiGLU's activation, and the
rotary embedding of queries and keys in place. References: `norm.rms_norm_reference`,
`norm.add_rms_norm_reference`, `activation.silu_and_mul_reference`,
`rotary.apply_rotary_reference`.

A prefill step's time on a GPU is mostly the host's: every eager op is a launch, and a layer's
norms, activation and rotary take about twenty of them as references. Each kernel rounds where
its reference rounds (to the activations' dtype after the residual add, after normalizing,
after each rotary product), so they differ from the references only in the order of the
variance's float32 sum. They run under `TRITON_INTERPRET=1` on CPU tensors, which is how CI
tests them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_ACTIVATION_BLOCK = 1024  # columns of SwiGLU's output per program


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    out_ptr,
    summed_ptr,
    weight_ptr,
    stride_x,
    stride_residual,
    stride_out,
    stride_summed,
    eps,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    ADD_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    columns = tl.arange(0, BLOCK)
    mask = columns < HIDDEN
    x = tl.load(x_ptr + row * stride_x + columns, mask=mask, other=0.0)
    if ADD_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_residual + columns, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)
        tl.store(summed_ptr + row * stride_summed + columns, x, mask=mask)
    x_fp32 = x.to(tl.float32)
    variance = tl.sum(x_fp32 * x_fp32, axis=0) / HIDDEN
    normed = (x_fp32 * tl.math.rsqrt(variance + eps)).to(x.dtype)
    weight = tl.load(weight_ptr + columns, mask=mask, other=0.0)
    out = (weight.to(tl.float32) * normed.to(tl.float32)).to(x.dtype)
    tl.store(out_ptr + row * stride_out + columns, out, mask=mask)


def _norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    num_tokens, hidden_size = x.shape
    out = torch.empty_like(x)
    summed = torch.empty_like(x) if residual is not None else None
    if num_tokens == 0:
        return out, summed
    _rms_norm_kernel[(num_tokens,)](
        x,
        residual if residual is not None else x,
        out,
        summed if summed is not None else out,
        weight,
        x.stride(0),
        residual.stride(0) if residual is not None else 0,
        out.stride(0),
        summed.stride(0) if summed is not None else 0,
        eps,
        HIDDEN=hidden_size,
        BLOCK=triton.next_power_of_2(hidden_size),
        ADD_RESIDUAL=residual is not None,
        num_warps=4 if hidden_size <= 2048 else 8,
    )
    return out, summed


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, hidden] with unit-stride rows, normalized and scaled by weight [hidden]."""
    return _norm(x, None, weight, eps)[0]


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual), both [T, hidden], in one pass."""
    out, summed = _norm(x, residual, weight, eps)
    return out, summed


@triton.jit
def _silu_and_mul_kernel(
    gate_up_ptr, out_ptr, stride_gate_up, stride_out, INTERMEDIATE: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = columns < INTERMEDIATE
    gate = tl.load(gate_up_ptr + row * stride_gate_up + columns, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * stride_gate_up + INTERMEDIATE + columns, mask=mask, other=0.0)
    gate_fp32 = gate.to(tl.float32)
    activated = (gate_fp32 / (1.0 + tl.exp(-gate_fp32))).to(gate.dtype)
    out = (activated.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)
    tl.store(out_ptr + row * stride_out + columns, out, mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of gate_up [T, 2 * intermediate] (unit-stride rows) -> [T, intermediate]."""
    num_tokens, width = gate_up.shape
    intermediate = width // 2
    out = torch.empty((num_tokens, intermediate), dtype=gate_up.dtype, device=gate_up.device)
    if num_tokens == 0:
        return out
    grid = (num_tokens, triton.cdiv(intermediate, _ACTIVATION_BLOCK))
    _silu_and_mul_kernel[grid](
        gate_up, out, gate_up.stride(0), out.stride(0), INTERMEDIATE=intermediate, BLOCK=_ACTIVATION_BLOCK
    )
    return out


@triton.jit
def _rotary_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    stride_x_token,
    stride_x_head,
    stride_cos_token,
    stride_sin_token,
    NUM_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HALF_PAD)
    mask = (heads < NUM_HEADS)[:, None] & (dims < HALF)[None, :]
    first = x_ptr + token * stride_x_token + heads[:, None] * stride_x_head + dims[None, :]
    x1 = tl.load(first, mask=mask, other=0.0)
    x2 = tl.load(first + HALF, mask=mask, other=0.0)
    dtype = x1.dtype
    cos = tl.load(cos_ptr + token * stride_cos_token + dims, mask=dims < HALF, other=0.0).to(tl.float32)[
        None, :
    ]
    sin = tl.load(sin_ptr + token * stride_sin_token + dims, mask=dims < HALF, other=0.0).to(tl.float32)[
        None, :
    ]
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    # Each product rounds to the activations' dtype before the sum, as the reference's ops do.
    out1 = (x1 * cos).to(dtype).to(tl.float32) - (x2 * sin).to(dtype).to(tl.float32)
    out2 = (x2 * cos).to(dtype).to(tl.float32) + (x1 * sin).to(dtype).to(tl.float32)
    tl.store(first, out1.to(dtype), mask=mask)
    tl.store(first + HALF, out2.to(dtype), mask=mask)


def apply_rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, head_dim] (unit-stride heads) in place with cos, sin [T, 1, head_dim]
    (each half the same, as `rotary.rotary_cos_sin` builds them); returns x."""
    num_tokens, num_heads, head_dim = x.shape
    if num_tokens == 0:
        return x
    half = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        x,
        cos,
        sin,
        x.stride(0),
        x.stride(1),
        cos.stride(0),
        sin.stride(0),
        NUM_HEADS=num_heads,
        HEADS_PAD=triton.next_power_of_2(num_heads),
        HALF=half,
        HALF_PAD=triton.next_power_of_2(half),
    )
    return x
