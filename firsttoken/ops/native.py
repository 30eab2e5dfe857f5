"""Hand-written CPU kernels, compiled from csrc/ with the machine's C compiler.

- Norms, rotary, SwiGLU and the KV write: a decode step spends more time dispatching torch's
  small ops than computing them (RMSNorm is eight ops, rotary seven, in every layer); each
  kernel here is one ctypes call, one pass over memory, split over torch's OpenMP threads
  once a step is large.
- Causal prefill attention, flash-style, and decode rows with its arithmetic
  (csrc/prefill_attention.c): on AMX tiles (x86-64 CPUs with AMX-BF16), else on AVX512-BF16.
- Flash attention in float32 arithmetic for every CPU class, float32 or bf16 tensors
  (csrc/attention.c): prefills, chunks reading their cached context in place through block
  ids, and decode rows with a prefill's bits.
- On x86-64 CPUs with AVX512-BF16: int4 and int8 projections for decode-sized steps
  (csrc/quantized_matmul_bf16.c; csrc/quantized_matmul.c holds their portable siblings), paged
  decode attention in one exact softmax (csrc/paged_decode_attention.c) and a whole int4
  decode step in one call over both (csrc/decode_step.c; see `firsttoken.ops.native_decode`).

The library is built once per source, compiler flags and CPU (cached in the folder the
caller names), with the limits and structs Python shares with it written from `native_abi`
into a header of the build; where no compiler works, `load_native_kernels` returns None and
callers keep the torch ops.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from firsttoken.arithmetic import ceil_div
from firsttoken.cache_lock import building
from firsttoken.ops import native_abi
from firsttoken.ops.cpu_info import cpu_flags
from firsttoken.ops.cpu_isa import CpuIsa, resolve_cpu_isa
from firsttoken.ops.hadamard import check_hadamard_block, hadamard_norm
from firsttoken.ops.weight_levels import PackedLevels, WeightLevels

logger = logging.getLogger(__name__)

_SOURCE_DIR = Path(__file__).parent / "csrc"
# Rows `NativeKernels.find_levels` tries first.
_LEVELS_PROBE_ROWS = 64
_SOURCES = [
    _SOURCE_DIR / name
    for name in (
        "row_kernels.c", "attention.c", "matmul.c", "quantized_matmul.c", "prefill_attention.c",
        "paged_decode_attention.c", "quantized_matmul_bf16.c", "decode_step.c", "portable_decode_step.c",
        "w8a8_rows.c", "w8a8_matmul.c", "w8a8_projection.c", "w8a8_step.c", "weight_levels.c",
        "logits.c",
    )
]
_HEADERS = [_SOURCE_DIR / "common.h", _SOURCE_DIR / "isa.h", _SOURCE_DIR / "decode_kernels.h"]
# Written into the build folder from `native_abi` (common.h includes it).
_ABI_HEADER_NAME = "native_abi.h"
# Reassociation lets sums vectorize. Not -ffast-math: a shared library built with it sets
# flush-to-zero for the whole process when loaded (denormals would read as 0 everywhere).
# OpenMP binds, by soname, to the libgomp torch has already loaded: one thread pool. The
# target ISA's flags (`cpu_isa`) follow these.
_COMPILE_FLAGS = [
    "-O3", "-fno-math-errno", "-fno-trapping-math", "-fassociative-math", "-fno-signed-zeros",
    "-fopenmp", "-shared", "-fPIC", "-std=c11",
]
_DTYPE_CODES = {torch.float32: native_abi.DTYPE_FLOAT32, torch.bfloat16: native_abi.DTYPE_BFLOAT16}

def supports(tensor: torch.Tensor) -> bool:
    """Whether the kernels take this tensor's device and dtype."""
    return tensor.device.type == "cpu" and tensor.dtype in _DTYPE_CODES


def heads_contiguous(x: torch.Tensor) -> bool:
    """x [rows, heads, head_dim] with each row's heads one contiguous run (rows may be strided),
    the layout every kernel here reads per-head tensors in."""
    return x.stride(2) == 1 and x.stride(1) == x.shape[2]


def attention_output(kernel: str, query: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """Where an attention kernel writes its rows: `out` where given (contiguous, query's shape
    and dtype, on the CPU: a caller's slice of the step's output, so the rows are not copied
    there afterwards), else a new tensor."""
    if out is None:
        return query.new_empty(query.shape)
    fits = out.shape == query.shape and out.dtype == query.dtype and out.device.type == "cpu"
    if not (fits and out.is_contiguous()):
        raise ValueError(
            f"{kernel}: out must be a contiguous CPU {query.dtype} tensor of the queries' shape "
            f"{tuple(query.shape)}, got {out.dtype} {tuple(out.shape)} on {out.device.type}"
            f"{'' if out.is_contiguous() else ', not contiguous'}"
        )
    return out


class NativeKernels:
    """Typed entry points into the compiled library; every tensor argument must pass `supports`."""

    def __init__(self, library: ctypes.CDLL) -> None:
        # Every kernel of `native_abi.KERNELS` this build holds, called with its parameters by name.
        self._kernels = {
            kernel.name: kernel.bind(library)
            for kernel in native_abi.KERNELS
            if kernel.requires is native_abi.Requires.ANY_ISA or hasattr(library, kernel.name)
        }
        # Asks the OS for the tile registers once for the process, as oneDNN does.
        self.has_amx = "ft_amx_available" in self._kernels and bool(self._kernels["ft_amx_available"]())
        # What the build targets: avx2, avx512, avx512_bf16 (+amx), neon or generic.
        self.isa: str = self._kernels["ft_isa_name"]().decode()
        self.has_decode_kernels = "ft_decode_step" in self._kernels
        self.has_prefill_attention = "ft_prefill_attention" in self._kernels
        self.has_w8a8_step = "ft_w8a8_step" in self._kernels
        # The portable flash attention takes head sizes in whole vectors of this build.
        self.flash_head_dim_multiple: int = self._kernels["ft_flash_attention_head_dim_multiple"]()
        # Output columns per panel of `pack_matmul_weight`'s layout: two vectors of this ISA.
        self.matmul_panel_width: int = self._kernels["ft_matmul_panel_width"]()

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x contiguous [rows, cols]."""
        out = torch.empty_like(x)
        rows, cols = x.shape
        _check(
            self._kernels["ft_rms_norm"](
                x=x.data_ptr(), weight=weight.data_ptr(), out=out.data_ptr(), rows=rows, cols=cols, eps=eps,
                dtype=_code(x), num_threads=torch.get_num_threads(),
            )
        )
        return out

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x and residual contiguous [rows, cols]; returns (normed, summed)."""
        out = torch.empty_like(x)
        summed = torch.empty_like(x)
        rows, cols = x.shape
        _check(
            self._kernels["ft_add_rms_norm"](
                x=x.data_ptr(), residual=residual.data_ptr(), weight=weight.data_ptr(), out=out.data_ptr(),
                summed=summed.data_ptr(), rows=rows, cols=cols, eps=eps, dtype=_code(x),
                num_threads=torch.get_num_threads(),
            )
        )
        return out, summed

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up contiguous [rows, 2 * half]."""
        rows, width = gate_up.shape
        out = gate_up.new_empty(rows, width // 2)
        _check(
            self._kernels["ft_silu_and_mul"](
                gate_up=gate_up.data_ptr(), out=out.data_ptr(), rows=rows, half=width // 2,
                dtype=_code(gate_up), num_threads=torch.get_num_threads(),
            )
        )
        return out

    def argmax_rows(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's `torch.argmax` (the first largest value; the first NaN where a row holds
        one) of float32 logits, contiguous [rows, vocab]: long [rows]."""
        if logits.dtype != torch.float32 or logits.dim() != 2 or not logits.is_contiguous():
            given = f"{logits.dtype} {list(logits.shape)}"
            raise ValueError(f"argmax_rows: contiguous float32 logits [rows, vocab], not {given}")
        rows, cols = logits.shape
        if cols == 0:
            raise ValueError("argmax_rows: rows of no values have no argmax")
        token_ids = torch.empty(rows, dtype=torch.long)
        _check(
            self._kernels["ft_argmax_rows"](
                logits=logits.data_ptr(), token_ids=token_ids.data_ptr(), rows=rows, cols=cols,
                num_threads=torch.get_num_threads(),
            )
        )
        return token_ids

    def quantize_rows_int8(
        self,
        x: torch.Tensor,
        column_scales: torch.Tensor | None = None,
        hadamard_block: int = 1,
        silu_gated: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x contiguous [rows, cols] (where `silu_gated`, x [rows, 2 * cols] is gate | up and its
        rows are `silu_and_mul`'s, bit for bit; times float32 column_scales [cols] where given,
        then turned by the Walsh-Hadamard transform in blocks of `hadamard_block` where above 1)
        -> (uint8 levels [rows, cols], float32 scales [rows]), as
        `firsttoken.ops.w8a8.quantize_rows`."""
        rows, cols = x.shape
        if silu_gated:
            if cols % 2 != 0:
                raise ValueError(f"quantize_rows_int8: gate | up rows need an even width, got {cols}")
            cols //= 2
        turn = _turn_arguments(cols, column_scales, hadamard_block)
        levels = torch.empty(rows, cols, dtype=torch.uint8)
        scales = torch.empty(rows, dtype=torch.float32)
        _check(
            self._kernels["ft_quantize_rows_int8"](
                x=x.data_ptr(), silu_gated=int(silu_gated), **turn, levels=levels.data_ptr(),
                scales=scales.data_ptr(), rows=rows, cols=cols,
                dtype=_code(x), num_threads=torch.get_num_threads(),
            )
        )
        return levels, scales

    def rms_norm_quantize_int8(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        weight: torch.Tensor,
        eps: float,
        column_scales: torch.Tensor | None = None,
        hadamard_block: int = 1,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`quantize_rows_int8(rms_norm(x + residual))` (residual None: of rms_norm(x)) in one pass,
        the normed rows never written: (levels, scales, x + residual as `add_rms_norm` returns it,
        or x where residual is None). x, residual contiguous [rows, cols]."""
        rows, cols = x.shape
        turn = _turn_arguments(cols, column_scales, hadamard_block)
        levels = torch.empty(rows, cols, dtype=torch.uint8)
        scales = torch.empty(rows, dtype=torch.float32)
        summed = torch.empty_like(x) if residual is not None else x
        _check(
            self._kernels["ft_rms_norm_quantize_int8"](
                x=x.data_ptr(), residual=residual.data_ptr() if residual is not None else None,
                weight=weight.data_ptr(), summed=summed.data_ptr(), eps=eps, **turn,
                levels=levels.data_ptr(), scales=scales.data_ptr(), rows=rows, cols=cols,
                dtype=_code(x), num_threads=torch.get_num_threads(),
            )
        )
        return levels, scales, summed

    @property
    def has_w8a8_matmul(self) -> bool:
        """Whether this build holds the exact int8 matmul (csrc/w8a8_matmul.c: x86 with AVX2)."""
        return "ft_w8a8_matmul" in self._kernels

    @property
    def w8a8_matmul_uses_vnni(self) -> bool:
        """Whether this build's int8 matmul multiplies on AVX512-VNNI (else on AVX2's VPMADDWD)."""
        return self.has_w8a8_matmul and bool(self._kernels["ft_w8a8_uses_vnni"]())

    @property
    def w8a8_matmul_uses_amx(self) -> bool:
        """Whether this build's int8 matmul multiplies on AMX-INT8 tiles (the OS lets the process
        use the tile registers): inputs in whole 64-byte tile rows; others on AVX512-VNNI."""
        return self.has_amx and "ft_w8a8_has_amx" in self._kernels

    @property
    def w8a8_matmul_makes_swiglu(self) -> bool:
        """Whether this build's int8 matmul can store SwiGLU's product of a gate | up projection
        (`silu_gated`): its AVX512-VNNI and AMX-INT8 kernels can."""
        return self.w8a8_matmul_uses_vnni

    def pack_w8a8_weight(self, weight: torch.Tensor, silu_gated: bool = False) -> torch.Tensor:
        """int8 levels [out, in] in `w8a8_matmul`'s layout (bytes; panels of outputs, as this
        build's matmul reads them). `silu_gated`: the rows are gate | up halves, paired in the
        panels for `w8a8_matmul(silu_gated=True)`."""
        out_features, in_features = weight.shape
        if silu_gated and not self.w8a8_matmul_makes_swiglu:
            raise ValueError(f"pack_w8a8_weight: the {self.isa} build's int8 matmul makes no SwiGLU product")
        if silu_gated and out_features % 2 != 0:
            raise ValueError(f"pack_w8a8_weight: gate | up rows need an even count, got {out_features}")
        packed = torch.empty(
            self._kernels["ft_w8a8_packed_bytes"](out_features=out_features, in_features=in_features),
            dtype=torch.uint8,
        )
        _check(
            self._kernels["ft_pack_w8a8_weight"](
                weight=weight.contiguous().data_ptr(), out_features=out_features, in_features=in_features,
                silu_gated=int(silu_gated), packed=packed.data_ptr(),
            )
        )
        return packed

    def w8a8_matmul(
        self,
        levels: torch.Tensor,
        row_scales: torch.Tensor,
        packed_weight: torch.Tensor,
        weight_scales: torch.Tensor,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
        use_amx: bool | None = None,
        silu_gated: bool = False,
    ) -> torch.Tensor:
        """[rows, out] in `dtype`: uint8 levels (level + 128) [rows, in] with float32 row_scales
        [rows] times the packed int8 weights with float32 weight_scales [out] (+ float32 bias),
        summed exactly in int32; on AMX-INT8 tiles where the build has them (`use_amx` None) or
        where asked, else on vectors: the same bits either way. `silu_gated` (weights packed so):
        [rows, out / 2], `silu_and_mul` of that gate | up product, bit for bit."""
        rows, in_features = levels.shape
        product = self._w8a8_product(
            "w8a8_matmul", rows, in_features, packed_weight, weight_scales, bias, dtype, use_amx, silu_gated
        )
        _check(
            self._kernels["ft_w8a8_matmul"](
                levels=levels.data_ptr(), row_scales=row_scales.data_ptr(), **product.arguments
            ),
            bad_shape=product.bad_shape,
        )
        return product.out

    def w8a8_quantize_matmul(
        self,
        x: torch.Tensor,
        packed_weight: torch.Tensor,
        weight_scales: torch.Tensor,
        bias: torch.Tensor | None,
        column_scales: torch.Tensor | None = None,
        hadamard_block: int = 1,
        silu_gated_inputs: bool = False,
        silu_gated: bool = False,
    ) -> torch.Tensor:
        """`w8a8_matmul` of `quantize_rows_int8(x, column_scales, hadamard_block, silu_gated_inputs)`
        in one call, the same bits: x contiguous [rows, in] ([rows, 2 * in] where
        `silu_gated_inputs`), in the output's dtype; the levels are never returned."""
        rows, cols = x.shape
        in_features = cols // 2 if silu_gated_inputs else cols
        if silu_gated_inputs and cols % 2 != 0:
            raise ValueError(f"w8a8_quantize_matmul: gate | up rows need an even width, got {cols}")
        turn = _turn_arguments(in_features, column_scales, hadamard_block)
        product = self._w8a8_product(
            "w8a8_quantize_matmul", rows, in_features, packed_weight, weight_scales, bias, x.dtype, None,
            silu_gated,
        )
        _check(
            self._kernels["ft_w8a8_quantize_matmul"](
                x=x.data_ptr(), silu_gated_inputs=int(silu_gated_inputs), **turn, **product.arguments
            ),
            bad_shape=product.bad_shape,
        )
        return product.out

    def w8a8_norm_matmul(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        norm_weight: torch.Tensor,
        eps: float,
        packed_weight: torch.Tensor,
        weight_scales: torch.Tensor,
        bias: torch.Tensor | None,
        column_scales: torch.Tensor | None = None,
        hadamard_block: int = 1,
        silu_gated: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`w8a8_matmul` of `rms_norm_quantize_int8(x, residual, norm_weight, eps, column_scales,
        hadamard_block)`'s levels in one call, the same bits: (the product, x + residual as
        `add_rms_norm` returns it, or x where residual is None). x, residual contiguous [rows, in]."""
        rows, in_features = x.shape
        turn = _turn_arguments(in_features, column_scales, hadamard_block)
        product = self._w8a8_product(
            "w8a8_norm_matmul", rows, in_features, packed_weight, weight_scales, bias, x.dtype, None,
            silu_gated,
        )
        summed = torch.empty_like(x) if residual is not None else x
        _check(
            self._kernels["ft_w8a8_norm_matmul"](
                x=x.data_ptr(), residual=residual.data_ptr() if residual is not None else None,
                norm_weight=norm_weight.data_ptr(), summed=summed.data_ptr(), eps=eps, **turn,
                **product.arguments,
            ),
            bad_shape=product.bad_shape,
        )
        return product.out, summed

    def _w8a8_product(
        self,
        caller: str,
        rows: int,
        in_features: int,
        packed_weight: torch.Tensor,
        weight_scales: torch.Tensor,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
        use_amx: bool | None,
        silu_gated: bool,
    ) -> _W8A8Product:
        """The output of an int8 product of `rows` rows and its kernel's arguments from the weight
        on (`ft_w8a8_matmul`'s and the one-call projections' alike), after checking that this
        build can make it."""
        use_amx = self.w8a8_matmul_uses_amx if use_amx is None else use_amx
        if use_amx and not self.w8a8_matmul_uses_amx:
            raise ValueError(f"{caller}: use_amx asked for where the build has no AMX-INT8 tiles")
        if silu_gated and not self.w8a8_matmul_makes_swiglu:
            raise ValueError(f"{caller}: the {self.isa} build's int8 matmul makes no SwiGLU product")
        out_features = weight_scales.shape[0]
        out = torch.empty(rows, out_features // 2 if silu_gated else out_features, dtype=dtype)
        return _W8A8Product(
            out=out,
            arguments={
                "weight": packed_weight.data_ptr(), "weight_scales": weight_scales.data_ptr(),
                "bias": bias.data_ptr() if bias is not None else None, "out": out.data_ptr(), "rows": rows,
                "out_features": out_features, "in_features": in_features, "dtype": _DTYPE_CODES[dtype],
                "num_threads": torch.get_num_threads(), "use_amx": int(use_amx),
                "silu_gated": int(silu_gated),
            },
            bad_shape=f"{caller}: SwiGLU's gate | up outputs need an even count, got {out_features}",
        )

    def rescale_rows(
        self, sums: torch.Tensor, row_scales: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype
    ) -> torch.Tensor:
        """float32 sums [rows, cols] * row_scales [rows] (+ float32 bias [cols]), in `dtype`."""
        rows, cols = sums.shape
        out = torch.empty(rows, cols, dtype=dtype)
        _check(
            self._kernels["ft_rescale_rows"](
                sums=sums.data_ptr(), row_scales=row_scales.data_ptr(),
                bias=bias.data_ptr() if bias is not None else None, out=out.data_ptr(), rows=rows, cols=cols,
                dtype=_DTYPE_CODES[dtype], num_threads=torch.get_num_threads(),
            )
        )
        return out

    def apply_rotary_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotates x [rows, heads, head_dim] (heads contiguous, rows strided) in place;
        cos and sin contiguous [rows, 1, head_dim]."""
        rows, heads, head_dim = x.shape
        _check(
            self._kernels["ft_rotary"](
                x=x.data_ptr(), row_stride=x.stride(0), rows=rows, heads=heads, head_dim=head_dim,
                cos=cos.data_ptr(), sin=sin.data_ptr(), dtype=_code(x), num_threads=torch.get_num_threads(),
            )
        )
        return x

    def write_kv(
        self, kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """key and value [rows, kv_heads, head_dim], heads contiguous (rows may be strided);
        kv_cache contiguous [2, blocks, block_size, kv_heads, head_dim]; slot_mapping contiguous int64."""
        rows, kv_heads, head_dim = key.shape
        num_slots = kv_cache.shape[1] * kv_cache.shape[2]
        status = self._kernels["ft_write_kv"](
            cache=kv_cache.data_ptr(), values_offset=kv_cache.numel() // 2, num_slots=num_slots,
            key=key.data_ptr(), key_row_stride=key.stride(0), value=value.data_ptr(),
            value_row_stride=value.stride(0), slots=slot_mapping.data_ptr(), rows=rows,
            row_elems=kv_heads * head_dim, dtype=_code(key), num_threads=torch.get_num_threads(),
        )
        _check(status, out_of_bounds=f"slot_mapping: a slot lies outside the cache's {num_slots} slots")

    def prefill_attention_supports(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
        """Whether `prefill_attention` takes these: bf16 on the CPU, heads contiguous, a head
        size of whole 32-dim tiles."""
        head_dim = query.shape[2]
        return (
            self.has_prefill_attention and query.dtype == key.dtype == value.dtype == torch.bfloat16
            and query.device.type == "cpu" and head_dim % native_abi.PREFILL_HEAD_DIM_MULTIPLE == 0
            and head_dim <= native_abi.PREFILL_MAX_HEAD_DIM
            and all(heads_contiguous(x) for x in (query, key, value))
        )

    def prefill_attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        num_threads: int,
        use_amx: bool | None = None,
        window: int = 0,
        softcap: float = 0.0,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Causal attention of query [n, heads, head_dim] over key and value [m, kv_heads,
        head_dim], m >= n, the queries being the last n of the m positions (new tokens after
        m - n of context); with `window` > 0 each over its last `window` keys (the keys before
        the first query's window never read); with `softcap` > 0 scaled scores s taken as
        softcap * tanh(s / softcap). Inputs must pass `prefill_attention_supports`.
        On AMX tiles where the CPU has them (`use_amx` None), else on AVX512-BF16. Written
        into `out` where given (see `attention_output`), which is returned."""
        use_amx = self.has_amx if use_amx is None else use_amx
        if use_amx and not self.has_amx:
            raise ValueError("prefill_attention: use_amx asked for on a CPU without AMX tiles")
        num_queries, num_heads, head_dim = query.shape
        num_keys, num_kv_heads = key.shape[0], key.shape[1]
        if (
            not 1 <= num_queries <= num_keys or value.shape[0] != num_keys or num_heads % num_kv_heads
            or window < 0 or softcap < 0
        ):
            raise ValueError(
                f"prefill_attention: {num_queries} queries of {num_heads} heads over {num_keys} keys and "
                f"{value.shape[0]} values of {num_kv_heads} heads, window {window}, softcap {softcap}"
            )
        out = attention_output("prefill_attention", query, out)
        _check(
            self._kernels["ft_prefill_attention"](
                query=query.data_ptr(), query_row_stride=query.stride(0), key=key.data_ptr(),
                key_row_stride=key.stride(0), value=value.data_ptr(), value_row_stride=value.stride(0),
                num_queries=num_queries, num_keys=num_keys, num_heads=num_heads, num_kv_heads=num_kv_heads,
                head_dim=head_dim, scale=head_dim**-0.5, window=window, softcap=softcap, out=out.data_ptr(),
                num_threads=max(1, num_threads), use_amx=int(use_amx),
            )
        )
        return out


    def flash_attention_supports(self, query: torch.Tensor, key_values: torch.Tensor) -> bool:
        """Whether the portable flash attention takes query [n, heads, head_dim] over K/V of
        `key_values`' dtype (a K tensor or the paged cache): the same dtype, float32 or bf16, on
        the CPU, query heads contiguous, a head size of whole vectors up to
        `native_abi.ATTENTION_MAX_HEAD_DIM`."""
        head_dim = query.shape[2]
        return (
            supports(query) and query.dtype == key_values.dtype and key_values.device.type == "cpu"
            and heads_contiguous(query) and head_dim % self.flash_head_dim_multiple == 0
            and head_dim <= native_abi.ATTENTION_MAX_HEAD_DIM
        )

    def flash_attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        num_threads: int,
        window: int = 0,
        softcap: float = 0.0,
        sink_tokens: int = 0,
        sink_query: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Causal attention of query [n, heads, head_dim] over key and value [m, kv_heads,
        head_dim] (heads contiguous, rows strided), m >= n, the queries being the last n of the m
        positions, each over its last `window` keys only when window > 0, scaled scores s taken as
        softcap * tanh(s / softcap) when softcap > 0; float32 arithmetic, the inputs' dtype out.
        With sink_tokens > 0 (and a window), keys 0..sink_tokens-1 too, scored with sink_query
        (shaped as query) once a row's window has left them (StreamingLLM). Inputs must pass
        `flash_attention_supports` (key and value too). Written into `out` where given (see
        `attention_output`), which is returned."""
        num_keys, num_kv_heads = key.shape[0], key.shape[1]
        if value.shape != key.shape or not (heads_contiguous(key) and heads_contiguous(value)):
            raise ValueError(f"flash_attention: keys {tuple(key.shape)} and values {tuple(value.shape)}")
        key_values = {
            "key": key.data_ptr(), "key_stride": key.stride(0), "value": value.data_ptr(),
            "value_stride": value.stride(0), "block_ids": None, "num_block_ids": 0, "block_size": 1,
            "num_slots": num_keys,
        }
        return self._flash_attention(
            "flash_attention", query, key_values, num_keys, num_kv_heads, num_threads,
            _Variant.of(query, window, softcap, sink_tokens, sink_query), out,
        )

    def flash_attention_paged(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        block_ids: torch.Tensor,
        num_keys: int,
        num_threads: int,
        window: int = 0,
        softcap: float = 0.0,
        sink_tokens: int = 0,
        sink_query: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`flash_attention` over the first num_keys keys of one sequence, read in place from
        kv_cache [2, blocks, block_size, kv_heads, head_dim] (contiguous) through its block ids
        (long [>= ceil(num_keys / block_size)]): a chunk on cached context with no gather, the
        bits `flash_attention` gives the same keys. Blocks wholly before every query's window
        are never read. Written into `out` where given, as `flash_attention`."""
        _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
        if not kv_cache.is_contiguous() or block_ids.dtype != torch.long or block_ids.dim() != 1:
            raise ValueError(f"flash_attention_paged: block ids {tuple(block_ids.shape)} {block_ids.dtype}")
        block_ids = block_ids.contiguous()
        kv_width = num_kv_heads * head_dim
        key_values = {
            "key": kv_cache[0].data_ptr(), "key_stride": kv_width, "value": kv_cache[1].data_ptr(),
            "value_stride": kv_width, "block_ids": block_ids.data_ptr(), "num_block_ids": block_ids.shape[0],
            "block_size": block_size, "num_slots": num_blocks * block_size,
        }
        return self._flash_attention(
            "flash_attention_paged", query, key_values, num_keys, num_kv_heads, num_threads,
            _Variant.of(query, window, softcap, sink_tokens, sink_query), out,
        )

    def _flash_attention(
        self,
        name: str,
        query: torch.Tensor,
        key_values: dict[str, int | None],
        num_keys: int,
        num_kv_heads: int,
        num_threads: int,
        variant: _Variant,
        out: torch.Tensor | None,
    ) -> torch.Tensor:
        """Runs ft_flash_attention over the K/V rows `key_values` locates (its parameters from
        `key` to `num_slots`), with `variant`'s window, softcap and sinks, into `out` (None: a
        new tensor)."""
        num_queries, num_heads, head_dim = query.shape
        out = attention_output(name, query, out)
        status = self._kernels["ft_flash_attention"](
            query=query.data_ptr(), query_stride=query.stride(0), **key_values, num_queries=num_queries,
            num_keys=num_keys, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
            scale=head_dim**-0.5, **variant.arguments(), out=out.data_ptr(), dtype=_code(query),
            num_threads=max(1, num_threads),
        )
        self._check_flash(status, name, query, num_keys, num_kv_heads)
        return out

    def flash_decode_attention(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        window: int = 0,
        softcap: float = 0.0,
        sink_tokens: int = 0,
        sink_query: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One new query per sequence, query [rows, heads, head_dim], over the first seq_lens[r]
        keys of sequence r (the last `window` of them when window > 0; softcap and sinks as
        `flash_attention`'s), read in place through
        block_table (long [rows, max_blocks]) from kv_cache [2, blocks, block_size, kv_heads,
        head_dim] (contiguous): for each row the bits `flash_attention` gives the last position of
        a prefill of those keys, whatever the other rows. Inputs must pass
        `flash_attention_supports`; seq_lens long [rows]."""
        rows = query.shape[0]
        if (
            block_table.shape[0] != rows or seq_lens.shape != (rows,) or not kv_cache.is_contiguous()
            or block_table.dtype != torch.long or seq_lens.dtype != torch.long
        ):
            raise ValueError(
                f"flash_decode_attention: {rows} queries, block table {tuple(block_table.shape)} "
                f"{block_table.dtype}, seq_lens {tuple(seq_lens.shape)} {seq_lens.dtype}"
            )
        block_table = block_table.contiguous()
        seq_lens = seq_lens.contiguous()
        out = query.new_empty(query.shape)
        variant = _Variant.of(query, window, softcap, sink_tokens, sink_query)
        status = self._kernels["ft_flash_decode_attention"](
            **_paged_decodes(query, kv_cache, block_table, seq_lens), **variant.arguments(),
            out=out.data_ptr(), dtype=_code(query), num_threads=torch.get_num_threads(),
        )
        self._check_flash(status, "flash_decode_attention", query, int(seq_lens.max()), kv_cache.shape[3])
        return out

    def _check_flash(
        self, status: int, name: str, query: torch.Tensor, num_keys: int, num_kv_heads: int
    ) -> None:
        if status == native_abi.Status.BAD_SHAPE:
            num_queries, num_heads, head_dim = query.shape
            raise ValueError(
                f"{name}: {num_queries} queries of {num_heads} heads over {num_keys} keys of "
                f"{num_kv_heads} heads (needs 1 <= queries <= keys and heads a multiple of KV heads), "
                f"head_dim {head_dim} (needs a "
                f"multiple of {self.flash_head_dim_multiple} up to {native_abi.ATTENTION_MAX_HEAD_DIM})"
            )
        _check(
            status,
            out_of_bounds=(
                f"{name}: a block id or sequence length lies outside the KV cache or the block table"
            ),
        )

    def pack_matmul_weight(self, weight: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W [out, in] in `row_invariant_matmul`'s layout: panels of `matmul_panel_width` output
        columns, [panels, in, panel_width] in `dtype` (float32 or bf16), the last panel zero-padded."""
        out_features, in_features = weight.shape
        width = self.matmul_panel_width
        full_panels, rest = divmod(out_features, width)
        # Written once in place (no zeroed, padded copy first): packing is a share of every start.
        packed = torch.empty(ceil_div(out_features, width), in_features, width, dtype=dtype)
        whole_panels = weight[: full_panels * width].view(full_panels, width, in_features)
        packed[:full_panels].copy_(whole_panels.transpose(1, 2))
        if rest:
            packed[full_panels].zero_()
            packed[full_panels, :, :rest].copy_(weight[full_panels * width :].t())
        return packed

    def row_invariant_matmul(
        self, x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None, out_features: int
    ) -> torch.Tensor:
        """x [rows, in] float32 (rows may be strided) times W^T, W packed by `pack_matmul_weight`,
        plus bias (float32 [out_features]) if given: each output is one FMA chain over the
        inputs in order, so a row's bits never depend on the other rows or the thread count."""
        rows, in_features = x.shape
        panels, packed_inputs, width = packed_weight.shape
        if (
            x.dtype != torch.float32 or x.stride(1) != 1 or packed_inputs != in_features
            or width != self.matmul_panel_width or not (panels - 1) * width < out_features <= panels * width
            or packed_weight.dtype not in _DTYPE_CODES or not packed_weight.is_contiguous()
            or (bias is not None and (bias.dtype != torch.float32 or bias.shape != (out_features,)))
        ):
            raise ValueError(
                f"row_invariant_matmul: x {tuple(x.shape)} {x.dtype}, packed weight "
                f"{tuple(packed_weight.shape)} {packed_weight.dtype} for {out_features} outputs, bias "
                f"{None if bias is None else (tuple(bias.shape), bias.dtype)}"
            )
        out = x.new_empty(rows, out_features)
        if rows == 0:
            return out
        bias = bias.contiguous() if bias is not None else None
        _check(
            self._kernels["ft_row_invariant_matmul"](
                x=x.data_ptr(), x_stride=x.stride(0), rows=rows, weight=packed_weight.data_ptr(),
                weight_dtype=_code(packed_weight), bias=None if bias is None else bias.data_ptr(),
                out_features=out_features, in_features=in_features, out=out.data_ptr(),
                num_threads=torch.get_num_threads(),
            )
        )
        return out

    def find_levels(self, weight: torch.Tensor) -> WeightLevels | None:
        """The levels form (ops/weight_levels.py) of a float32 CPU weight [out, in] whose every
        value it rebuilds bit for bit: 4-bit levels with offsets (Q4_0, Q4_1), else 8-bit ones
        (Q8_0); None for any other. The first rows go first: a weight of another form fails on
        them at a small share of the cost."""
        if (
            weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 2
            or weight.shape[1] % native_abi.LEVELS_GROUP != 0
        ):
            return None
        weight = weight.contiguous()
        for level_bits in (4, 8):
            if self._find_levels(weight[:_LEVELS_PROBE_ROWS], level_bits) is not None:
                found = self._find_levels(weight, level_bits)
                if found is not None:
                    return found
        return None

    def _find_levels(self, weight: torch.Tensor, level_bits: int) -> WeightLevels | None:
        """`weight` (contiguous float32 [out, in], in a multiple of `native_abi.LEVELS_GROUP`) as
        `level_bits` levels that rebuild every value bit for bit, or None where a group has none."""
        rows, cols = weight.shape
        groups = cols // native_abi.LEVELS_GROUP
        levels = torch.empty(rows, cols, dtype=torch.uint8 if level_bits == 4 else torch.int8)
        scales = torch.empty(rows, groups)
        offsets = torch.empty(rows, groups)
        status = self._kernels["ft_find_weight_levels"](
            weight=weight.data_ptr(), rows=rows, cols=cols, level_bits=level_bits, levels=levels.data_ptr(),
            scales=scales.data_ptr(), offsets=offsets.data_ptr(), num_threads=torch.get_num_threads(),
        )
        if status == native_abi.Status.BAD_SHAPE:
            return None
        _check(status)
        return WeightLevels(level_bits, levels, scales, offsets if level_bits == 4 else None)

    def row_invariant_levels_matmul(
        self, x: torch.Tensor, packed: PackedLevels, bias: torch.Tensor | None, out_features: int
    ) -> torch.Tensor:
        """`row_invariant_matmul`'s bits for a weight given as levels (`weight_levels`), packed
        for this ISA's panel width, reading only its levels and scales: x [rows, in] float32,
        rows <= `native_abi.LEVELS_MAX_ROWS`."""
        rows, in_features = x.shape
        panels, packed_inputs, _ = packed.levels.shape
        width = self.matmul_panel_width
        if (
            x.dtype != torch.float32 or x.stride(1) != 1 or packed_inputs != in_features
            or rows > native_abi.LEVELS_MAX_ROWS or not (panels - 1) * width < out_features <= panels * width
            or packed.scales.shape != (panels, in_features // native_abi.LEVELS_GROUP, width)
            or (bias is not None and (bias.dtype != torch.float32 or bias.shape != (out_features,)))
        ):
            raise ValueError(
                f"row_invariant_levels_matmul: x {tuple(x.shape)} {x.dtype} (at most "
                f"{native_abi.LEVELS_MAX_ROWS} rows), levels {tuple(packed.levels.shape)}, scales "
                f"{tuple(packed.scales.shape)} for {out_features} outputs of panels {width} wide"
            )
        out = x.new_empty(rows, out_features)
        if rows == 0:
            return out
        bias = bias.contiguous() if bias is not None else None
        _check(
            self._kernels["ft_row_invariant_levels_matmul"](
                x=x.data_ptr(), x_stride=x.stride(0), rows=rows, levels=packed.levels.data_ptr(),
                level_bits=packed.bits, scales=packed.scales.data_ptr(),
                offsets=None if packed.offsets is None else packed.offsets.data_ptr(),
                bias=None if bias is None else bias.data_ptr(), out_features=out_features,
                in_features=in_features, out=out.data_ptr(), num_threads=torch.get_num_threads(),
            )
        )
        return out

    def int4_matmul(
        self, levels: torch.Tensor, scales_zeros: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor
    ) -> torch.Tensor:
        """x [rows, in] . W^T for rows <= `native_abi.DECODE_MAX_ROWS`, in a multiple of 64, all
        bf16 and contiguous; W in the layout of `firsttoken.ops.linear.pack_int4`: levels uint8
        [out, in / 2], scales_zeros [out, 2 * in / 32]."""
        return self._quantized_matmul(
            "int4", levels, scales_zeros, bias, x, 2 * levels.shape[1], native_abi.INT4_INPUT_MULTIPLE
        )

    def int8_matmul(
        self, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor
    ) -> torch.Tensor:
        """x [rows, in] . (scales * W)^T for int8 W [out, in] (in a multiple of 16), rows <=
        `native_abi.DECODE_MAX_ROWS`; x, scales [out] and bias bf16; all contiguous."""
        return self._quantized_matmul(
            "int8", weight, scales, bias, x, weight.shape[1], native_abi.INT8_INPUT_MULTIPLE
        )

    @property
    def has_float32_logits(self) -> bool:
        """Whether this build holds the bf16 LM head with float32 logits (csrc/logits.c: AVX512-BF16)."""
        return "ft_bf16_logits" in self._kernels

    def pack_logits_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """A bf16 head's weight [vocab, hidden] (hidden a multiple of 4) in `float32_logits`' layout."""
        vocab, hidden = weight.shape
        if weight.dtype != torch.bfloat16 or hidden % 4:
            raise ValueError(
                "pack_logits_weight: bf16 weights of a width divisible by 4, "
                f"got {weight.dtype} {tuple(weight.shape)}"
            )
        elements = self._kernels["ft_logits_packed_elements"](vocab=vocab, hidden=hidden)
        packed = torch.empty(elements, dtype=torch.bfloat16)
        _check(
            self._kernels["ft_pack_logits_weight"](
                weight=weight.contiguous().data_ptr(), vocab=vocab, hidden=hidden, packed=packed.data_ptr()
            )
        )
        return packed

    def float32_logits(
        self, x: torch.Tensor, packed_weight: torch.Tensor, vocab: int, use_amx: bool | None = None
    ) -> torch.Tensor:
        """float32 [rows, vocab] = x bf16 [rows, hidden] . W^T for W packed by `pack_logits_weight`,
        each logit summed in float32 and never rounded to bf16; a row's logits do not depend on
        the other rows. On AMX tiles where the CPU has them (`use_amx` None, hidden a multiple of
        32) or where asked, else on VDPBF16PS: each the same bits at any row count, not each
        other's."""
        use_amx = self.has_amx and x.shape[1] % 32 == 0 if use_amx is None else use_amx
        if use_amx and not self.has_amx:
            raise ValueError("float32_logits: use_amx asked for where the build has no AMX tiles")
        rows, hidden = x.shape
        if x.dtype != torch.bfloat16 or packed_weight.numel() != self._kernels["ft_logits_packed_elements"](
            vocab=vocab, hidden=hidden
        ):
            raise ValueError(f"float32_logits: {x.dtype} rows of {hidden} for a head of {vocab} outputs")
        x = x.contiguous()
        out = torch.empty(rows, vocab, dtype=torch.float32)
        _check(
            self._kernels["ft_bf16_logits"](
                x=x.data_ptr(), packed=packed_weight.data_ptr(), rows=rows, vocab=vocab, hidden=hidden,
                out=out.data_ptr(), num_threads=torch.get_num_threads(), use_amx=int(use_amx),
            )
        )
        return out

    def portable_int4_matmul(
        self, levels: torch.Tensor, scales_zeros: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor
    ) -> torch.Tensor:
        """x [rows, in] . W^T (+ bias) on any ISA, rows <= `native_abi.DECODE_MAX_ROWS`, in a
        multiple of 32; x and bias float32 or bf16 (one dtype, the output's), all contiguous; W
        in the layout of `firsttoken.ops.linear.pack_int4` (scales_zeros bf16)."""
        return self._portable_matmul(
            "int4", levels, scales_zeros, bias, x, 2 * levels.shape[1],
            native_abi.PORTABLE_INT4_INPUT_MULTIPLE,
        )

    def portable_int8_matmul(
        self, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor
    ) -> torch.Tensor:
        """x [rows, in] . (scales * W)^T (+ bias) on any ISA for int8 W [out, in] (in a multiple
        of 16), rows <= `native_abi.DECODE_MAX_ROWS`; x, scales [out] and bias float32 or bf16 (one
        dtype, the output's), all contiguous."""
        if scales.dtype != x.dtype:
            raise ValueError(f"portable_int8_matmul: scales in {scales.dtype}, inputs in {x.dtype}")
        return self._portable_matmul(
            "int8", weight, scales, bias, x, weight.shape[1], native_abi.INT8_INPUT_MULTIPLE
        )

    def _portable_matmul(
        self,
        kind: str,
        weight: torch.Tensor,
        scales: torch.Tensor,
        bias: torch.Tensor | None,
        x: torch.Tensor,
        weight_inputs: int,
        input_multiple: int,
    ) -> torch.Tensor:
        name = f"portable_{kind}_matmul"
        rows, in_features = x.shape
        takes_rows = 1 <= rows <= native_abi.DECODE_MAX_ROWS
        if (
            not takes_rows
            or weight_inputs != in_features
            or in_features % input_multiple
            or x.dtype not in _DTYPE_CODES
        ):
            raise ValueError(
                f"{name}: {rows} rows of {in_features} {x.dtype} inputs for weights {tuple(weight.shape)}"
            )
        if bias is not None and bias.dtype != x.dtype:
            raise ValueError(f"{name}: bias in {bias.dtype}, inputs in {x.dtype}")
        out_features = weight.shape[0]
        out = x.new_empty(rows, out_features)
        _check(
            self._kernels[f"ft_{name}"](
                **_quantized_weight(kind, weight, scales, bias), out_features=out_features,
                in_features=in_features, x=x.data_ptr(), rows=rows, out=out.data_ptr(), dtype=_code(x),
                num_threads=torch.get_num_threads(),
            )
        )
        return out

    def _quantized_matmul(
        self,
        kind: str,
        weight: torch.Tensor,
        scales: torch.Tensor,
        bias: torch.Tensor | None,
        x: torch.Tensor,
        weight_inputs: int,
        input_multiple: int,
    ) -> torch.Tensor:
        name = f"{kind}_matmul"
        rows, in_features = x.shape
        takes_rows = 1 <= rows <= native_abi.DECODE_MAX_ROWS
        if not takes_rows or weight_inputs != in_features or in_features % input_multiple:
            raise ValueError(f"{name}: {rows} rows of {in_features} inputs for weights {tuple(weight.shape)}")
        out_features = weight.shape[0]
        out = x.new_empty(rows, out_features)
        _check(
            self._kernels[f"ft_{name}"](
                **_quantized_weight(kind, weight, scales, bias), out_features=out_features,
                in_features=in_features, x=x.data_ptr(), rows=rows, out=out.data_ptr(),
                num_threads=torch.get_num_threads(),
            )
        )
        return out

    def paged_decode_attention_supports(self, query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
        """Whether `paged_decode_attention` takes these: bf16 on the CPU, query heads
        contiguous, a contiguous cache, a head size of 32 to `native_abi.DECODE_MAX_HEAD_DIM`
        in whole 32-dim chunks."""
        head_dim = query.shape[2]
        return (
            self.has_decode_kernels and query.dtype == kv_cache.dtype == torch.bfloat16
            and query.device.type == "cpu" and kv_cache.is_contiguous() and heads_contiguous(query)
            and head_dim % native_abi.DECODE_HEAD_DIM_MULTIPLE == 0
            and head_dim <= native_abi.DECODE_MAX_HEAD_DIM
        )

    def paged_decode_attention(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        as_prefill: bool = False,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        """Attention of one new query per sequence, query [rows, heads, head_dim], over the
        first seq_lens[r] keys of sequence r, read in place through block_table (long [rows,
        max_blocks]) from kv_cache [2, blocks, block_size, kv_heads, head_dim]. Inputs must pass
        `paged_decode_attention_supports`; seq_lens long [rows]. `as_prefill`: with the prefill
        kernel's arithmetic (its 64-key tiles and online softmax; block_size a multiple of
        16), so a row gets the bits a prefill of the same tokens gives its position; else one
        exact softmax over all keys, a little faster. With `as_prefill` only: `window` > 0,
        each row over its last `window` keys, the blocks before them never read; `softcap` > 0,
        scaled scores s taken as softcap * tanh(s / softcap)."""
        rows, num_heads, _ = query.shape
        _, _, block_size, num_kv_heads, _ = kv_cache.shape
        if (
            block_table.shape[0] != rows or seq_lens.shape != (rows,) or num_heads % num_kv_heads
            or block_table.dtype != torch.long or seq_lens.dtype != torch.long
            or (as_prefill and block_size % native_abi.DECODE_AS_PREFILL_BLOCK_MULTIPLE)
            or window < 0 or softcap < 0 or ((window or softcap) and not as_prefill)
        ):
            raise ValueError(
                f"paged_decode_attention: {rows} queries of {num_heads} heads, block table "
                f"{tuple(block_table.shape)} {block_table.dtype}, seq_lens {tuple(seq_lens.shape)} "
                f"{seq_lens.dtype}, "
                f"{num_kv_heads} KV heads, blocks of {block_size}, window {window}, softcap {softcap} "
                f"(as_prefill {as_prefill})"
            )
        block_table = block_table.contiguous()
        seq_lens = seq_lens.contiguous()
        out = query.new_empty(query.shape)
        arguments = {
            **_paged_decodes(query, kv_cache, block_table, seq_lens), "out": out.data_ptr(),
            "num_threads": torch.get_num_threads(),
        }
        if as_prefill:
            status = self._kernels["ft_decode_attention_as_prefill"](
                **arguments, window=window, softcap=softcap, use_amx=int(self.has_amx)
            )
        else:
            status = self._kernels["ft_paged_decode_attention"](**arguments)
        _check(
            status,
            out_of_bounds="paged_decode_attention: a block id or sequence length lies outside the KV cache",
        )
        return out

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
        _check(
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
        _check(
            status,
            out_of_bounds=(
                f"decode step: more than {native_abi.DECODE_MAX_ROWS} sequences, or a slot, block id "
                "or sequence length outside the KV cache"
            ),
            bad_shape="decode step: a head size or grouping of heads the attention does not take",
        )


def _turn_arguments(cols: int, column_scales: torch.Tensor | None, hadamard_block: int) -> dict[str, object]:
    """A W8A8 quantization pass's column scales and Hadamard arguments, the block checked against
    the row width."""
    check_hadamard_block(cols, hadamard_block)
    return {
        "column_scales": column_scales.data_ptr() if column_scales is not None else None,
        "hadamard_block": hadamard_block,
        "hadamard_norm": hadamard_norm(hadamard_block),
    }


def _code(tensor: torch.Tensor) -> int:
    return _DTYPE_CODES[tensor.dtype]


@dataclass
class _W8A8Product:
    """An int8 product's output, its kernel's dtype / threads / AMX / SwiGLU arguments, and what
    a refused shape means."""

    out: torch.Tensor
    arguments: dict[str, int]
    bad_shape: str


@dataclass
class _Variant:
    """The flash kernels' window, softcap and sink arguments, holding the sink query (laid out as
    the query: the kernels step through both by its row stride) while the kernel runs."""

    window: int
    softcap: float
    sink_tokens: int
    sink_query: torch.Tensor | None

    @classmethod
    def of(
        cls,
        query: torch.Tensor,
        window: int,
        softcap: float,
        sink_tokens: int,
        sink_query: torch.Tensor | None,
    ) -> _Variant:
        if sink_query is not None:
            if sink_query.shape != query.shape or sink_query.dtype != query.dtype:
                raise ValueError(
                    f"sink_query: {tuple(sink_query.shape)} {sink_query.dtype}, query {tuple(query.shape)}"
                )
            if sink_query.stride() != query.stride():
                laid_out = torch.empty_strided(query.shape, query.stride(), dtype=query.dtype)
                sink_query = laid_out.copy_(sink_query)
        return cls(window, softcap, sink_tokens, sink_query)

    def arguments(self) -> dict[str, int | float | None]:
        return {
            "window": self.window, "softcap": self.softcap, "sink_tokens": self.sink_tokens,
            "sink_query": self.sink_query.data_ptr() if self.sink_query is not None else None,
        }


def _paged_decodes(
    query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor
) -> dict[str, int | float]:
    """The parameters every paged decode attention kernel shares: query [rows, heads, head_dim]
    over kv_cache [2, blocks, block_size, kv_heads, head_dim] through block_table (contiguous
    long [rows, max_blocks]) and seq_lens (contiguous long [rows])."""
    rows, num_heads, head_dim = query.shape
    _, num_blocks, block_size, num_kv_heads, _ = kv_cache.shape
    return {
        "query": query.data_ptr(), "query_stride": query.stride(0), "kv_cache": kv_cache.data_ptr(),
        "num_slots": num_blocks * block_size, "block_table": block_table.data_ptr(),
        "max_blocks": block_table.shape[1], "seq_lens": seq_lens.data_ptr(), "block_size": block_size,
        "rows": rows, "num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim,
        "scale": head_dim**-0.5,
    }


def _quantized_weight(
    kind: str, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
) -> dict[str, int | None]:
    """The weight parameters of the `kind` ("int4" or "int8") projection kernels."""
    bias_pointer = None if bias is None else bias.data_ptr()
    if kind == "int4":
        return {"levels": weight.data_ptr(), "scales_zeros": scales.data_ptr(), "bias": bias_pointer}
    return {"weight": weight.data_ptr(), "scales": scales.data_ptr(), "bias": bias_pointer}


def _check(
    status: int,
    out_of_bounds: str = "native kernel: an index lies outside its tensor",
    bad_shape: str = "native kernel: a shape it does not take",
) -> None:
    """Raises for a kernel's failure status: IndexError (`out_of_bounds` says what lay outside),
    ValueError (`bad_shape`) or MemoryError."""
    if status == native_abi.Status.OUT_OF_BOUNDS:
        raise IndexError(out_of_bounds)
    if status == native_abi.Status.BAD_SHAPE:
        raise ValueError(bad_shape)
    if status == native_abi.Status.OUT_OF_MEMORY:
        raise MemoryError("native kernel: could not allocate its scratch memory or start its threads")


@functools.cache
def load_native_kernels(cache_dir: str, cpu_isa: str = "auto") -> NativeKernels | None:
    """The compiled kernels for `cpu_isa` (see `firsttoken.ops.cpu_isa`), built into `cache_dir`
    on first use; None where they cannot be built. An ISA this CPU cannot run is an error."""
    isa = resolve_cpu_isa(cpu_isa)
    if platform.system() != "Linux":
        return None
    try:
        return NativeKernels(ctypes.CDLL(str(_built_library(Path(cache_dir), isa))))
    except subprocess.CalledProcessError as error:
        compiler_errors = error.stderr.decode(errors="replace").strip()
        logger.warning(
            "native CPU kernels unavailable, using torch ops (the build failed: %s)", compiler_errors
        )
        return None
    except (OSError, subprocess.SubprocessError) as error:
        logger.warning("native CPU kernels unavailable, using torch ops (%s)", error)
        return None


def check_sources(isa: CpuIsa, work_dir: Path) -> None:
    """Compiles the kernel sources for `isa` without generating code, in `work_dir`: a check of
    every ISA's branches against the ABI header that needs no CPU able to run them. Raises
    subprocess.CalledProcessError, the compiler's errors in its stderr."""
    (work_dir / _ABI_HEADER_NAME).write_text(native_abi.c_header())
    subprocess.run(
        [*_compiler_and_flags(isa), f"-I{work_dir}", *map(str, _SOURCES), "-fsyntax-only"],
        check=True, capture_output=True, timeout=120,
    )


def _compiler_and_flags(isa: CpuIsa) -> list[str]:
    return [os.environ.get("CC", "cc"), *_COMPILE_FLAGS, *isa.compiler_flags]


def _built_library(cache_dir: Path, isa: CpuIsa) -> Path:
    sources = [path.read_bytes() for path in _SOURCES + _HEADERS]
    abi_header = native_abi.c_header()
    compiler_and_flags = _compiler_and_flags(isa)
    build_command = " ".join(compiler_and_flags).encode()
    key = hashlib.sha256(b"\0".join([*sources, abi_header.encode(), build_command, _cpu_identity()]))
    library = cache_dir / f"cpu_kernels-{key.hexdigest()[:16]}.so"
    if library.exists():
        return library
    with building(str(library.with_suffix(".lock")), f"the {isa.name} kernels"):
        if not library.exists():
            _build_library(compiler_and_flags, abi_header, library)
    return library


def _build_library(compiler_and_flags: list[str], abi_header: str, library: Path) -> None:
    cache_dir = library.parent
    cache_dir.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: a process never loads a half-written file.
    with tempfile.TemporaryDirectory(dir=cache_dir) as build_dir:
        (Path(build_dir) / _ABI_HEADER_NAME).write_text(abi_header)
        partial = Path(build_dir) / library.name
        objects = _compile_objects(compiler_and_flags, Path(build_dir))
        subprocess.run(
            [*compiler_and_flags, *map(str, objects), "-o", str(partial), "-lm"],
            check=True, capture_output=True, timeout=120,
        )
        os.replace(partial, library)


def _compile_objects(compiler_and_flags: list[str], build_dir: Path) -> list[Path]:
    """Each source compiled to an object file in `build_dir`, one compiler per core: a user's
    first start waits for this build."""

    def compile_source(source: Path) -> Path:
        target = build_dir / f"{source.stem}.o"
        subprocess.run(
            [*compiler_and_flags, f"-I{build_dir}", "-c", str(source), "-o", str(target)],
            check=True, capture_output=True, timeout=120,
        )
        return target

    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        return list(pool.map(compile_source, _SOURCES))


def _cpu_identity() -> bytes:
    """-march=native and -mtune=native code is made for CPUs with these features: key the build by them."""
    return f"{platform.machine()}|{' '.join(sorted(cpu_flags()))}".encode()
