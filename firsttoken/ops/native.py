"""Hand-written CPU kernels, compiled from csrc/ with the machine's C compiler
(`firsttoken.ops.native_build`), grouped by what they compute:

- `rows` (`native_rows`): norms, rotary, SwiGLU, argmax, the int8 sums' rescaling, one ctypes
  call and one pass over memory each, where torch dispatches several small ops.
- `attention` (`native_attention`): the KV write, and causal prefill and paged decode attention
  on AMX tiles or AVX512-BF16.
- `flash` (`native_flash_attention`): flash attention in float32 arithmetic for every CPU
  class: prefills, chunks over the paged cache, decode rows with a prefill's bits.
- `matmul` (`native_matmul`): the row-invariant matmul on float or levels weights, and the bf16
  LM head with float32 logits.
- `quantized` (`native_quantized_matmul`): int4 and int8 projections of decode-sized steps.
- `w8a8` (`native_w8a8`): int8 row quantization and the exact int8 matmul.
- `steps` (`native_steps`): a whole decode step (int4) or W8A8 step in one call.

Where no compiler works, `load_native_kernels` returns None and callers keep the torch ops.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import platform
import subprocess
from dataclasses import dataclass
from pathlib import Path

from firsttoken.ops import native_build
from firsttoken.ops.cpu_isa import resolve_cpu_isa
from firsttoken.ops.native_attention import AttentionKernels
from firsttoken.ops.native_flash_attention import FlashAttentionKernels
from firsttoken.ops.native_library import NativeLibrary
from firsttoken.ops.native_matmul import MatmulKernels
from firsttoken.ops.native_quantized_matmul import QuantizedMatmulKernels
from firsttoken.ops.native_rows import RowKernels
from firsttoken.ops.native_steps import StepKernels
from firsttoken.ops.native_w8a8 import W8A8Kernels

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class NativeKernels:
    """Typed entry points into the compiled library, by what they compute; every tensor argument
    must pass `native_library.supports`."""

    # What the build targets: avx2, avx512, avx512_bf16 (+amx), neon or generic.
    isa: str
    # Whether the OS lets the process use AMX tile registers.
    has_amx: bool
    # Whether the build holds the AVX512-BF16 decode kernels (`NativeLibrary.has_decode_kernels`).
    has_decode_kernels: bool
    rows: RowKernels
    attention: AttentionKernels
    flash: FlashAttentionKernels
    matmul: MatmulKernels
    quantized: QuantizedMatmulKernels
    w8a8: W8A8Kernels
    steps: StepKernels

    @classmethod
    def bind(cls, library: ctypes.CDLL) -> NativeKernels:
        bound = NativeLibrary.bind(library)
        return cls(
            isa=bound.isa,
            has_amx=bound.has_amx,
            has_decode_kernels=bound.has_decode_kernels,
            rows=RowKernels(bound),
            attention=AttentionKernels(bound),
            flash=FlashAttentionKernels(bound),
            matmul=MatmulKernels(bound),
            quantized=QuantizedMatmulKernels(bound),
            w8a8=W8A8Kernels(bound),
            steps=StepKernels(bound),
        )


@functools.cache
def load_native_kernels(cache_dir: str, cpu_isa: str = "auto") -> NativeKernels | None:
    """The compiled kernels for `cpu_isa` (see `firsttoken.ops.cpu_isa`), built into `cache_dir`
    on first use; None where they cannot be built. An ISA this CPU cannot run is an error."""
    isa = resolve_cpu_isa(cpu_isa)
    if platform.system() != "Linux":
        return None
    try:
        return NativeKernels.bind(ctypes.CDLL(str(native_build.built_library(Path(cache_dir), isa))))
    except subprocess.CalledProcessError as error:
        compiler_errors = error.stderr.decode(errors="replace").strip()
        logger.warning(
            "native CPU kernels unavailable, using torch ops (the build failed: %s)", compiler_errors
        )
        return None
    except (OSError, subprocess.SubprocessError) as error:
        logger.warning("native CPU kernels unavailable, using torch ops (%s)", error)
        return None
