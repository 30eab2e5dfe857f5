"""W8A8 kernels (csrc/w8a8_rows.c, csrc/w8a8_matmul.c, csrc/w8a8_projection.c): activations
quantized to int8 per row (after an RMSNorm, a SwiGLU, column scales or a Hadamard turn, in the
same pass), and the exact int8 matmul of x86 builds with AVX2, alone or in one call with that
quantization."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from firsttoken.ops.hadamard import check_hadamard_block, hadamard_norm
from firsttoken.ops.native_library import DTYPE_CODES, NativeLibrary, check, dtype_code


def _turn_arguments(cols: int, column_scales: torch.Tensor | None, hadamard_block: int) -> dict[str, object]:
    """A W8A8 quantization pass's column scales and Hadamard arguments, the block checked against
    the row width."""
    check_hadamard_block(cols, hadamard_block)
    return {
        "column_scales": column_scales.data_ptr() if column_scales is not None else None,
        "hadamard_block": hadamard_block,
        "hadamard_norm": hadamard_norm(hadamard_block),
    }


@dataclass
class _W8A8Product:
    """An int8 product's output, its kernel's dtype / threads / AMX / SwiGLU arguments, and what
    a refused shape means."""

    out: torch.Tensor
    arguments: dict[str, int]
    bad_shape: str


class W8A8Kernels:
    """Rows quantized to int8 levels and their products with packed int8 weights."""

    def __init__(self, library: NativeLibrary) -> None:
        self._library = library
        self._kernels = library.kernels

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
        check(
            self._kernels["ft_quantize_rows_int8"](
                x=x.data_ptr(), silu_gated=int(silu_gated), **turn, levels=levels.data_ptr(),
                scales=scales.data_ptr(), rows=rows, cols=cols,
                dtype=dtype_code(x), num_threads=torch.get_num_threads(),
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
        check(
            self._kernels["ft_rms_norm_quantize_int8"](
                x=x.data_ptr(), residual=residual.data_ptr() if residual is not None else None,
                weight=weight.data_ptr(), summed=summed.data_ptr(), eps=eps, **turn,
                levels=levels.data_ptr(), scales=scales.data_ptr(), rows=rows, cols=cols,
                dtype=dtype_code(x), num_threads=torch.get_num_threads(),
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
        return self._library.has_amx and "ft_w8a8_has_amx" in self._kernels

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
            raise ValueError(
                f"pack_w8a8_weight: the {self._library.isa} build's int8 matmul makes no SwiGLU product"
            )
        if silu_gated and out_features % 2 != 0:
            raise ValueError(f"pack_w8a8_weight: gate | up rows need an even count, got {out_features}")
        packed = torch.empty(
            self._kernels["ft_w8a8_packed_bytes"](out_features=out_features, in_features=in_features),
            dtype=torch.uint8,
        )
        check(
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
        check(
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
        check(
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
        check(
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
            raise ValueError(f"{caller}: the {self._library.isa} build's int8 matmul makes no SwiGLU product")
        out_features = weight_scales.shape[0]
        out = torch.empty(rows, out_features // 2 if silu_gated else out_features, dtype=dtype)
        return _W8A8Product(
            out=out,
            arguments={
                "weight": packed_weight.data_ptr(), "weight_scales": weight_scales.data_ptr(),
                "bias": bias.data_ptr() if bias is not None else None, "out": out.data_ptr(), "rows": rows,
                "out_features": out_features, "in_features": in_features, "dtype": DTYPE_CODES[dtype],
                "num_threads": torch.get_num_threads(), "use_amx": int(use_amx),
                "silu_gated": int(silu_gated),
            },
            bad_shape=f"{caller}: SwiGLU's gate | up outputs need an even count, got {out_features}",
        )
