"""Resolves the dtype and batch invariance a worker runs: as asked, or, where the options say
"auto", measured on this machine (worker/compute_choice.py's rules over
worker/compute_probe.py's timings) and cached.

Measured where a probe runs the engine's own CPU kernels: an unquantized Llama-family model of
plain attention on one rank with the native kernels. Elsewhere dtype "auto" is read from the
CPU's flags (bf16 where it has bf16 dot-product instructions oneDNN uses) and batch invariance
"auto" is on, as before the measurement existed.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import torch

from firsttoken.config import EngineConfig
from firsttoken.models.arch import ModelArch
from firsttoken.models.loaders.checkpoint import Checkpoint
from firsttoken.ops.linear import cpu_computes_bf16
from firsttoken.worker.compute_choice import (
    ComputeChoice,
    ComputeRequest,
    candidate_forms,
    choice_key,
    load_or_choose,
)
from firsttoken.worker.compute_probe import measure_forms, probe_tokens
from firsttoken.worker.device import dtype_choice, resolve_dtype
from firsttoken.worker.model_loading import max_model_len, native_kernels_for

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class ResolvedCompute:
    """What the worker runs, why (a line each for the start-up log), and the measurement behind it."""

    dtype: torch.dtype
    batch_invariant: bool
    dtype_reason: str
    invariance_reason: str
    measured: ComputeChoice | None


def resolve_compute(
    config: EngineConfig, checkpoint: Checkpoint, device: torch.device, cache_dir: str, num_threads: int
) -> ResolvedCompute:
    """The dtype and batch invariance of a worker of `config` on `checkpoint`."""
    model_config = config.model_config
    request = ComputeRequest(model_config.dtype, model_config.batch_invariant)
    why_not = _why_not_measured(config, checkpoint.arch, device)
    native_kernels = native_kernels_for(model_config, device, cache_dir) if why_not is None else None
    if why_not is None and native_kernels is None:
        why_not = "without native kernels"
    forms = candidate_forms(request, cpu_computes_bf16()) if why_not is None else []
    if len(forms) < 2:
        return _unmeasured(request, device, why_not)
    arch = checkpoint.arch
    prefill_tokens = probe_tokens(
        arch, min(config.scheduler.max_num_batched_tokens, max_model_len(arch, None) - 1)
    )
    key = choice_key(native_kernels.isa, num_threads, arch_shapes(arch), request)

    def measure():
        logger.info(
            "measuring %s on this CPU for this model's shapes (once; later starts read it from the cache)",
            " and ".join(_measured_options(request)),
        )
        started = time.perf_counter()
        timings = measure_forms(
            forms, arch, checkpoint.rope_frequency_divisors, native_kernels, config.attention, prefill_tokens
        )
        logger.info("measured %d compute forms in %.2f s", len(forms), time.perf_counter() - started)
        return timings, prefill_tokens

    choice, _ = load_or_choose(os.path.join(cache_dir, "compute_choice"), key, request, measure)
    return ResolvedCompute(
        _DTYPES[choice.dtype], choice.batch_invariant, choice.dtype_reason, choice.invariance_reason, choice
    )


def _why_not_measured(config: EngineConfig, arch: ModelArch, device: torch.device) -> str | None:
    model_config = config.model_config
    if device.type != "cpu":
        return f"on {device.type}"
    if model_config.quantization is not None:
        return "with quantized weights"
    if config.parallel.tensor_parallel_size > 1:
        return "with tensor parallelism"
    if not arch.plain_llama_layers or arch.sliding_window is not None:
        return "for this model's layers"
    if config.streaming_llm.window is not None:
        return "with a streaming window"
    return None


def _unmeasured(request: ComputeRequest, device: torch.device, why_not: str | None) -> ResolvedCompute:
    dtype = resolve_dtype(request.dtype, device)
    if request.batch_invariant == "auto":
        not_measured = f", not measured {why_not}" if why_not else ""
        invariance_reason = f"batch invariance auto: on{not_measured}"
    else:
        state = "on" if request.batch_invariant else "off"
        invariance_reason = f"batch invariance {state}, as asked"
    return ResolvedCompute(
        dtype,
        request.batch_invariant in (True, "auto"),
        dtype_choice(request.dtype, device),
        invariance_reason,
        None,
    )


def _measured_options(request: ComputeRequest) -> list[str]:
    options = ["dtype"] if request.dtype == "auto" else []
    return options + (["batch invariance's cost"] if request.batch_invariant == "auto" else [])


def arch_shapes(arch: ModelArch) -> str:
    """What of the architecture the probe's timings depend on."""
    return (
        f"{arch.architecture}:h{arch.hidden_size}:i{arch.intermediate_size}:l{arch.num_layers}:"
        f"q{arch.num_heads}:kv{arch.num_kv_heads}:d{arch.head_dim}:v{arch.vocab_size}:"
        f"t{int(arch.tie_word_embeddings)}:b{int(arch.attention_bias)}"
    )
