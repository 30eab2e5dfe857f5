"""Matmuls of float activations: the row-invariant matmul (csrc/matmul.c) on float32 or bf16
weights packed in panels, or on levels found in float32 weights (csrc/weight_levels.c), and the
bf16 LM head with float32 logits (csrc/logits.c, AVX512-BF16 builds)."""

from __future__ import annotations

import torch

from firsttoken.arithmetic import ceil_div
from firsttoken.ops import native_abi
from firsttoken.ops.native_library import DTYPE_CODES, NativeLibrary, check, dtype_code
from firsttoken.ops.weight_levels import PackedLevels, WeightLevels

# Rows `MatmulKernels.find_levels` tries first.
_LEVELS_PROBE_ROWS = 64


class MatmulKernels:
    """Products whose every output sums its inputs in one fixed order, whatever the rows."""

    def __init__(self, library: NativeLibrary) -> None:
        self._library = library
        self._kernels = library.kernels
        # Output columns per panel of `pack_matmul_weight`'s layout: two vectors of this ISA.
        self.matmul_panel_width: int = self._kernels["ft_matmul_panel_width"]()

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
            or packed_weight.dtype not in DTYPE_CODES or not packed_weight.is_contiguous()
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
        check(
            self._kernels["ft_row_invariant_matmul"](
                x=x.data_ptr(), x_stride=x.stride(0), rows=rows, weight=packed_weight.data_ptr(),
                weight_dtype=dtype_code(packed_weight), bias=None if bias is None else bias.data_ptr(),
                out_features=out_features, in_features=in_features, out=out.data_ptr(),
                num_threads=torch.get_num_threads(),
            )
        )
        return out

    def find_levels(self, weight: torch.Tensor) -> WeightLevels | None:
        """The levels form (ops/weight_levels.py) of a float32 CPU weight [out, in] whose every
        value it rebuilds bit for bit: 4-bit levels with offsets (Q4_0, Q4_1, Q4_K), else 8-bit ones
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
        check(status)
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
        check(
            self._kernels["ft_row_invariant_levels_matmul"](
                x=x.data_ptr(), x_stride=x.stride(0), rows=rows, levels=packed.levels.data_ptr(),
                level_bits=packed.bits, scales=packed.scales.data_ptr(),
                offsets=None if packed.offsets is None else packed.offsets.data_ptr(),
                bias=None if bias is None else bias.data_ptr(), out_features=out_features,
                in_features=in_features, out=out.data_ptr(), num_threads=torch.get_num_threads(),
            )
        )
        return out

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
        check(
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
        use_amx = self._library.has_amx and x.shape[1] % 32 == 0 if use_amx is None else use_amx
        if use_amx and not self._library.has_amx:
            raise ValueError("float32_logits: use_amx asked for where the build has no AMX tiles")
        rows, hidden = x.shape
        if x.dtype != torch.bfloat16 or packed_weight.numel() != self._kernels["ft_logits_packed_elements"](
            vocab=vocab, hidden=hidden
        ):
            raise ValueError(f"float32_logits: {x.dtype} rows of {hidden} for a head of {vocab} outputs")
        x = x.contiguous()
        out = torch.empty(rows, vocab, dtype=torch.float32)
        check(
            self._kernels["ft_bf16_logits"](
                x=x.data_ptr(), packed=packed_weight.data_ptr(), rows=rows, vocab=vocab, hidden=hidden,
                out=out.data_ptr(), num_threads=torch.get_num_threads(), use_amx=int(use_amx),
            )
        )
        return out
