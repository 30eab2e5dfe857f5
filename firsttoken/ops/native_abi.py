"""What Python and the compiled kernels (csrc/) must agree on, declared once for both sides.

The kernels' limits and shape multiples, their dtype codes, the status every kernel returns,
the structs the decode step reads and every exported function's parameter list are defined
here only: the build (`native_build.py`) writes `c_header()` into the build folder as
native_abi.h, which csrc/common.h includes, so the compiler checks each kernel's definition
against its declaration here; Python fills the ctypes classes below and calls each kernel
by its parameters' names (`bind`). A constant, a field or a parameter cannot change on one
side alone; the header's text is part of the build's cache key, so a change rebuilds.
"""

from __future__ import annotations

import ctypes
import enum
from collections.abc import Callable
from dataclasses import dataclass

# Most rows the int4 and int8 kernels and the decode step take: each row's accumulators
# live in registers.
DECODE_MAX_ROWS = 8
# The decode step's attention keeps one head's output in registers, 16 dims to a register.
DECODE_MAX_HEAD_DIM = 128
# Prefill attention holds a block of queries and their outputs on the stack, sized for this
# head size. A separate limit from the decode step's, equal today.
PREFILL_MAX_HEAD_DIM = 128
# The largest head size the portable flash attention (csrc/attention.c) takes: its row of
# zeros (keys past the last) is this long.
ATTENTION_MAX_HEAD_DIM = 256
# The decode step's attention and its paged decode attention take head sizes in whole
# chunks of this many dims (two 16-float registers of bf16 pairs).
DECODE_HEAD_DIM_MULTIPLE = 32
# Prefill attention's head sizes: whole tiles of this many dims.
PREFILL_HEAD_DIM_MULTIPLE = 32
# Decode rows with the prefill kernel's arithmetic gather this many keys at a time from one block.
DECODE_AS_PREFILL_BLOCK_MULTIPLE = 16
# Prefill attention's keys stream through in blocks of this many, from key 0: keys given from a
# multiple of it on meet the same blocks.
PREFILL_KEY_BLOCK = 64
# int4 weights share a scale and a zero per group of this many inputs: GGUF's Q4_0/Q4_1 block
# size, so a Q4_1 tensor (w = d * q + m per 32 weights, q in 0..15) requantizes to exactly its
# own levels, since each block's min is m and its max is m + 15 d.
INT4_GROUP_SIZE = 32
# The AVX512-BF16 int4 kernel reads its inputs two groups at a time; the portable one a group
# at a time.
INT4_INPUT_MULTIPLE = 2 * INT4_GROUP_SIZE
PORTABLE_INT4_INPUT_MULTIPLE = INT4_GROUP_SIZE
# Both int8 kernels read their inputs 16 at a time.
INT8_INPUT_MULTIPLE = 16
# The row-invariant matmul's weights as levels (GGUF's Q4_0/Q4_1/Q8_0 blocks): one scale (and
# offset) per this many inputs of an output; at most this many rows a call, decode-sized steps
# being the ones bound by reading the weights.
LEVELS_GROUP = 32
LEVELS_MAX_ROWS = 8
# The `dtype` argument of the kernels that take either (bf16 as its raw uint16 bits).
DTYPE_FLOAT32 = 0
DTYPE_BFLOAT16 = 1

_C_CONSTANTS = {
    "DECODE_MAX_ROWS": DECODE_MAX_ROWS,
    "DECODE_MAX_HEAD_DIM": DECODE_MAX_HEAD_DIM,
    "PREFILL_MAX_HEAD_DIM": PREFILL_MAX_HEAD_DIM,
    "ATTENTION_MAX_HEAD_DIM": ATTENTION_MAX_HEAD_DIM,
    "DECODE_HEAD_DIM_MULTIPLE": DECODE_HEAD_DIM_MULTIPLE,
    "PREFILL_HEAD_DIM_MULTIPLE": PREFILL_HEAD_DIM_MULTIPLE,
    "DECODE_AS_PREFILL_BLOCK_MULTIPLE": DECODE_AS_PREFILL_BLOCK_MULTIPLE,
    "PREFILL_KEY_BLOCK": PREFILL_KEY_BLOCK,
    "INT4_GROUP_SIZE": INT4_GROUP_SIZE,
    "INT4_INPUT_MULTIPLE": INT4_INPUT_MULTIPLE,
    "PORTABLE_INT4_INPUT_MULTIPLE": PORTABLE_INT4_INPUT_MULTIPLE,
    "INT8_INPUT_MULTIPLE": INT8_INPUT_MULTIPLE,
    "LEVELS_GROUP": LEVELS_GROUP,
    "LEVELS_MAX_ROWS": LEVELS_MAX_ROWS,
    "DTYPE_FLOAT32": DTYPE_FLOAT32,
    "DTYPE_BFLOAT16": DTYPE_BFLOAT16,
}


class Status(enum.IntEnum):
    """What a kernel returns (C: `FtStatus`, its members prefixed `FT_`)."""

    OK = 1
    OUT_OF_MEMORY = 0  # its scratch memory or its threads could not be had
    OUT_OF_BOUNDS = -1  # a slot, block id or length lies outside the cache or its table; nothing touched
    BAD_SHAPE = -2  # a head size or a grouping of heads it does not take


# A field's C type: scalar text ("int64_t"), pointer text ("const uint16_t *": a c_void_p in
# Python, which passes tensors' data_ptr()), or another struct of this module, held by value.
CType = str | type[ctypes.Structure]
_C_SCALARS = {"int64_t": ctypes.c_int64, "int": ctypes.c_int, "float": ctypes.c_float}


def _python_type(c_type: CType) -> type:
    if isinstance(c_type, type):
        return c_type
    if c_type.endswith("*"):
        return ctypes.c_void_p
    return _C_SCALARS[c_type]


def _shared_struct(struct: type[ctypes.Structure]) -> type[ctypes.Structure]:
    """Lays out a ctypes struct from its `c_fields`, (name, C type) pairs in C order."""
    struct._fields_ = [(name, _python_type(c_type)) for name, c_type in struct.c_fields]
    return struct


@_shared_struct
class Int4Weight(ctypes.Structure):
    """An int4 projection in the layout of `firsttoken.ops.quantized_linear.pack_int4`."""

    c_fields: tuple[tuple[str, CType], ...] = (
        ("levels", "const uint8_t *"),  # [out, in / 2]
        ("scales_zeros", "const uint16_t *"),  # bf16 [out, 2 * in / 32]: a row's group scales, then its zeros
        ("bias", "const void *"),  # [out] in the activations' dtype (the AVX512-BF16 kernels': bf16), or NULL
        ("out_features", "int64_t"),
        ("in_features", "int64_t"),
    )


@_shared_struct
class DecodeLayer(ctypes.Structure):
    """One decoder layer's weights and KV cache."""

    c_fields: tuple[tuple[str, CType], ...] = (
        ("input_norm", "const void *"),  # [hidden] in the model's dtype, as are the others
        ("post_attention_norm", "const void *"),  # [hidden]
        ("qkv", Int4Weight),
        ("o", Int4Weight),
        ("gate_up", Int4Weight),
        ("down", Int4Weight),
        ("kv_cache", "void *"),  # [2, num_slots, kv_heads * head_dim]
        ("window", "int64_t"),  # > 0: each query sees its last `window` keys (the float32 step only)
    )


@_shared_struct
class DecodeModel(ctypes.Structure):
    """The model's dimensions and its layers."""

    c_fields: tuple[tuple[str, CType], ...] = (
        ("num_layers", "int64_t"),
        ("hidden_size", "int64_t"),
        ("num_heads", "int64_t"),
        ("num_kv_heads", "int64_t"),
        ("head_dim", "int64_t"),
        ("intermediate_size", "int64_t"),
        ("num_slots", "int64_t"),
        ("rms_norm_eps", "float"),
        ("attention_scale", "float"),
        ("layers", "const DecodeLayer *"),  # [num_layers]
    )


@_shared_struct
class DecodeBatch(ctypes.Structure):
    """One decode step's sequences: where their new K/V go and which blocks they read."""

    c_fields: tuple[tuple[str, CType], ...] = (
        ("num_sequences", "int64_t"),
        ("max_blocks", "int64_t"),
        ("block_size", "int64_t"),
        ("slot_mapping", "const int64_t *"),  # [num_sequences]
        ("block_table", "const int64_t *"),  # [num_sequences, max_blocks]
        ("seq_lens", "const int64_t *"),  # [num_sequences]: keys each attends over, its new one included
        ("cos", "const void *"),  # [num_sequences, head_dim] in the model's dtype
        ("sin", "const void *"),  # [num_sequences, head_dim]
    )


@_shared_struct
class W8A8Weight(ctypes.Structure):
    """A W8A8 projection on the native int8 matmul (`firsttoken.ops.w8a8_linear.W8A8Linear`)."""

    c_fields: tuple[tuple[str, CType], ...] = (
        ("packed", "const void *"),  # ft_pack_w8a8_weight's layout (SwiGLU-paired for gate_up)
        ("weight_scales", "const float *"),  # [out_features]
        ("bias", "const float *"),  # [out_features] or NULL
        ("column_scales", "const float *"),  # [in_features] (SmoothQuant's 1 / s) or NULL
        ("hadamard_block", "int64_t"),  # the inputs turned in blocks of this many where above 1
        ("hadamard_norm", "float"),
        ("out_features", "int64_t"),  # the weight's rows (gate | up both, for gate_up)
        ("in_features", "int64_t"),
    )


@_shared_struct
class W8A8StepLayer(ctypes.Structure):
    """One decoder layer as the whole-step W8A8 forward reads it."""

    c_fields: tuple[tuple[str, CType], ...] = (
        ("input_norm", "const void *"),  # bf16 [hidden]
        ("post_attention_norm", "const void *"),  # bf16 [hidden]
        ("qkv", W8A8Weight),
        ("o", W8A8Weight),
        ("gate_up", W8A8Weight),  # packed SwiGLU-paired: the product's epilogue stores silu(gate) * up
        ("down", W8A8Weight),
        ("kv_cache", "void *"),  # bf16 [2, num_slots, kv_heads * head_dim]
    )


@_shared_struct
class W8A8StepModel(ctypes.Structure):
    """The model's dimensions, its layers, and how its kernels run."""

    c_fields: tuple[tuple[str, CType], ...] = (
        ("num_layers", "int64_t"),
        ("hidden_size", "int64_t"),
        ("num_heads", "int64_t"),
        ("num_kv_heads", "int64_t"),
        ("head_dim", "int64_t"),
        ("intermediate_size", "int64_t"),
        ("num_slots", "int64_t"),
        ("rms_norm_eps", "float"),
        ("attention_scale", "float"),  # head_dim ** -0.5, as the attention kernels' wrappers pass it
        ("matmul_amx", "int"),  # the int8 matmul on AMX-INT8 tiles
        ("attention_amx", "int"),  # the prefill attention (and decodes as prefill) on AMX-BF16 tiles
        ("decode_as_prefill", "int"),  # decode rows with the prefill kernel's arithmetic
        ("layers", "const W8A8StepLayer *"),  # [num_layers]
    )


@_shared_struct
class W8A8StepBatch(ctypes.Structure):
    """One step: its decode rows first (one new token each, attending through the block table),
    then its prefill chunks; where their K/V go; the rotary's cos and sin."""

    c_fields: tuple[tuple[str, CType], ...] = (
        ("num_tokens", "int64_t"),
        ("num_decodes", "int64_t"),
        ("block_size", "int64_t"),
        ("max_blocks", "int64_t"),
        ("block_table", "const int64_t *"),  # [num_decodes, max_blocks]
        ("seq_lens", "const int64_t *"),  # [num_decodes]: keys each decode attends over, its own included
        ("num_prefills", "int64_t"),
        ("prefills", "const int64_t *"),  # [num_prefills, 3]: first row, rows, context tokens before them
        # [num_prefills]: the slot of each sequence's first key where its blocks are consecutive ids
        # (keys read in place), else -1 (keys gathered from its blocks).
        ("first_slots", "const int64_t *"),
        ("max_prefill_blocks", "int64_t"),
        ("prefill_blocks", "const int64_t *"),  # [num_prefills, max_prefill_blocks]: each one's blocks
        ("slot_mapping", "const int64_t *"),  # [num_tokens]
        ("cos", "const void *"),  # bf16 [num_tokens, head_dim]
        ("sin", "const void *"),  # bf16 [num_tokens, head_dim]
    )


# In declaration order: a struct follows those it holds.
_SHARED_STRUCTS = (
    Int4Weight, DecodeLayer, DecodeModel, DecodeBatch,
    W8A8Weight, W8A8StepLayer, W8A8StepModel, W8A8StepBatch,
)


class Requires(enum.Enum):
    """Which builds export a kernel: every one, or those whose target has the extension."""

    ANY_ISA = "any ISA"
    VECTOR_BF16 = "AVX512-BF16"
    AMX = "AMX tiles"
    AMX_INT8 = "AMX-INT8 tiles"
    AVX2 = "AVX2 (every x86-64 build but generic)"


@dataclass(frozen=True)
class Kernel:
    """One exported C function: its name, its parameters in C order as (name, C type) pairs,
    its result and the builds that hold it."""

    name: str
    parameters: tuple[tuple[str, str], ...]
    result: str = "FtStatus"
    requires: Requires = Requires.ANY_ISA

    def bind(self, library: ctypes.CDLL) -> Callable[..., int | bytes]:
        """The library's function, called with every parameter by name (a missing or unknown
        one is a TypeError); it returns an int (a `Status` where `result` is FtStatus), or
        bytes for a string result."""
        restype = ctypes.c_char_p if self.result.endswith("*") else _C_SCALARS.get(self.result, ctypes.c_int)
        prototype = ctypes.CFUNCTYPE(restype, *(_python_type(c_type) for _, c_type in self.parameters))
        return prototype((self.name, library), tuple((1, name) for name, _ in self.parameters))


def _parameters(c_text: str) -> tuple[tuple[str, str], ...]:
    """C parameter declarations ("const void *x, int64_t rows") as (name, C type) pairs."""
    pairs = []
    for declaration in filter(None, (part.strip() for part in c_text.split(","))):
        c_type, name = declaration.rsplit("*", 1) if "*" in declaration else declaration.rsplit(" ", 1)
        pairs.append((name.strip(), f"{c_type.strip()} *" if "*" in declaration else c_type.strip()))
    return tuple(pairs)


# The row kernels' parameters after their tensors and sizes: tensors in `dtype`, work split
# over up to num_threads OpenMP threads.
_DTYPE_THREADS = "int dtype, int num_threads"
# One new query per sequence attending over its first seq_lens[r] keys, read in place
# through block_table [rows, max_blocks] from one layer's cache [2, num_slots, kv_heads * head_dim].
_PAGED_DECODES = (
    "int64_t query_stride, const void *kv_cache, int64_t num_slots, const int64_t *block_table, "
    "int64_t max_blocks, const int64_t *seq_lens, int64_t block_size, int64_t rows, int64_t num_heads, "
    "int64_t num_kv_heads, int64_t head_dim, float scale"
)
_BF16_PAGED_DECODES = (
    f"const uint16_t *query, {_PAGED_DECODES.replace('const void *', 'const uint16_t *')}, uint16_t *out, "
    "int num_threads"
)
# out [rows, out_features] = x [rows, in_features] . W^T (+ bias), after the weight's parameters.
_PROJECTION = "int64_t out_features, int64_t in_features"

KERNELS = (
    Kernel(
        "ft_rms_norm",
        _parameters(
            "const void *x, const void *weight, void *out, int64_t rows, int64_t cols, float eps, "
            f"{_DTYPE_THREADS}"
        ),
    ),
    Kernel(
        "ft_add_rms_norm",
        _parameters(
            "const void *x, const void *residual, const void *weight, void *out, void *summed, int64_t rows, "
            f"int64_t cols, float eps, {_DTYPE_THREADS}"
        ),
    ),
    Kernel(
        "ft_silu_and_mul",
        _parameters(f"const void *gate_up, void *out, int64_t rows, int64_t half, {_DTYPE_THREADS}"),
    ),
    Kernel(
        "ft_quantize_rows_int8",
        _parameters(
            "const void *x, int silu_gated, const float *column_scales, int64_t hadamard_block, "
            "float hadamard_norm, uint8_t *levels, float *scales, int64_t rows, int64_t cols, "
            f"{_DTYPE_THREADS}"
        ),
    ),
    Kernel(
        "ft_rms_norm_quantize_int8",
        _parameters(
            "const void *x, const void *residual, const void *weight, void *summed, float eps, "
            "const float *column_scales, int64_t hadamard_block, float hadamard_norm, uint8_t *levels, "
            f"float *scales, int64_t rows, int64_t cols, {_DTYPE_THREADS}"
        ),
    ),
    Kernel(
        "ft_rescale_rows",
        _parameters(
            "const float *sums, const float *row_scales, const float *bias, void *out, int64_t rows, "
            f"int64_t cols, {_DTYPE_THREADS}"
        ),
    ),
    Kernel(
        "ft_rotary",
        _parameters(
            "void *x, int64_t row_stride, int64_t rows, int64_t heads, int64_t head_dim, const void *cos, "
            f"const void *sin, {_DTYPE_THREADS}"
        ),
    ),
    Kernel(
        "ft_write_kv",
        _parameters(
            "void *cache, int64_t values_offset, int64_t num_slots, const void *key, int64_t key_row_stride, "
            "const void *value, int64_t value_row_stride, const int64_t *slots, int64_t rows, "
            f"int64_t row_elems, {_DTYPE_THREADS}"
        ),
    ),
    Kernel(
        "ft_flash_attention",
        _parameters(
            "const void *query, int64_t query_stride, const void *key, int64_t key_stride, "
            "const void *value, int64_t value_stride, const int64_t *block_ids, int64_t num_block_ids, "
            "int64_t block_size, int64_t num_slots, int64_t num_queries, int64_t num_keys, "
            "int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, float scale, int64_t window, "
            f"float softcap, int64_t sink_tokens, const void *sink_query, void *out, {_DTYPE_THREADS}"
        ),
    ),
    Kernel(
        "ft_flash_decode_attention",
        _parameters(
            f"const void *query, {_PAGED_DECODES}, int64_t window, float softcap, int64_t sink_tokens, "
            f"const void *sink_query, void *out, {_DTYPE_THREADS}"
        ),
    ),
    Kernel("ft_flash_attention_head_dim_multiple", (), result="int"),
    Kernel(
        "ft_portable_int4_matmul",
        _parameters(
            f"const uint8_t *levels, const uint16_t *scales_zeros, const void *bias, {_PROJECTION}, "
            f"const void *x, int64_t rows, void *out, {_DTYPE_THREADS}"
        ),
    ),
    Kernel(
        "ft_portable_int8_matmul",
        _parameters(
            f"const int8_t *weight, const void *scales, const void *bias, {_PROJECTION}, const void *x, "
            f"int64_t rows, void *out, {_DTYPE_THREADS}"
        ),
    ),
    Kernel(
        "ft_portable_decode_step",
        _parameters("const DecodeModel *model, const DecodeBatch *batch, float *hidden, int num_threads"),
    ),
    Kernel("ft_matmul_panel_width", (), result="int"),
    Kernel(
        "ft_row_invariant_matmul",
        _parameters(
            "const float *x, int64_t x_stride, int64_t rows, const void *weight, int weight_dtype, "
            f"const float *bias, {_PROJECTION}, float *out, int num_threads"
        ),
    ),
    Kernel(
        "ft_row_invariant_levels_matmul",
        _parameters(
            "const float *x, int64_t x_stride, int64_t rows, const uint8_t *levels, int level_bits, "
            f"const float *scales, const float *offsets, const float *bias, {_PROJECTION}, float *out, "
            "int num_threads"
        ),
    ),
    Kernel(
        "ft_find_weight_levels",
        _parameters(
            "const float *weight, int64_t rows, int64_t cols, int level_bits, uint8_t *levels, "
            "float *scales, float *offsets, int num_threads"
        ),
    ),
    Kernel(
        "ft_argmax_rows",
        _parameters("const float *logits, int64_t *token_ids, int64_t rows, int64_t cols, int num_threads"),
    ),
    Kernel("ft_isa_name", (), result="const char *"),
    Kernel("ft_w8a8_uses_vnni", (), result="int", requires=Requires.AVX2),
    Kernel("ft_w8a8_packed_bytes", _parameters(_PROJECTION), result="int64_t", requires=Requires.AVX2),
    Kernel(
        "ft_pack_w8a8_weight",
        _parameters(f"const int8_t *weight, {_PROJECTION}, int silu_gated, void *packed"),
        requires=Requires.AVX2,
    ),
    Kernel(
        "ft_w8a8_matmul",
        _parameters(
            "const uint8_t *levels, const float *row_scales, const void *weight, "
            f"const float *weight_scales, const float *bias, void *out, int64_t rows, {_PROJECTION}, "
            f"{_DTYPE_THREADS}, int use_amx, int silu_gated"
        ),
        requires=Requires.AVX2,
    ),
    Kernel(
        "ft_w8a8_quantize_matmul",
        _parameters(
            "const void *x, int silu_gated_inputs, const float *column_scales, int64_t hadamard_block, "
            "float hadamard_norm, const void *weight, const float *weight_scales, const float *bias, "
            f"void *out, int64_t rows, {_PROJECTION}, {_DTYPE_THREADS}, int use_amx, int silu_gated"
        ),
        requires=Requires.AVX2,
    ),
    Kernel(
        "ft_w8a8_norm_matmul",
        _parameters(
            "const void *x, const void *residual, const void *norm_weight, void *summed, float eps, "
            "const float *column_scales, int64_t hadamard_block, float hadamard_norm, const void *weight, "
            "const float *weight_scales, const float *bias, void *out, int64_t rows, "
            f"{_PROJECTION}, {_DTYPE_THREADS}, int use_amx, int silu_gated"
        ),
        requires=Requires.AVX2,
    ),
    Kernel("ft_w8a8_has_amx", (), result="int", requires=Requires.AMX_INT8),
    Kernel("ft_amx_available", (), result="int", requires=Requires.AMX),
    Kernel(
        "ft_w8a8_step",
        _parameters(
            "const W8A8StepModel *model, const W8A8StepBatch *batch, uint16_t *hidden, uint16_t *residual, "
            "int num_threads"
        ),
        requires=Requires.VECTOR_BF16,
    ),
    Kernel(
        "ft_prefill_attention",
        _parameters(
            "const void *query, int64_t query_row_stride, const void *key, int64_t key_row_stride, "
            "const void *value, int64_t value_row_stride, int64_t num_queries, int64_t num_keys, "
            "int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, float scale, int64_t window, "
            "float softcap, void *out, int num_threads, int use_amx"
        ),
        requires=Requires.VECTOR_BF16,
    ),
    Kernel(
        "ft_int4_matmul",
        _parameters(
            f"const uint8_t *levels, const uint16_t *scales_zeros, const uint16_t *bias, {_PROJECTION}, "
            "const uint16_t *x, int64_t rows, uint16_t *out, int num_threads"
        ),
        requires=Requires.VECTOR_BF16,
    ),
    Kernel(
        "ft_int8_matmul",
        _parameters(
            f"const int8_t *weight, const uint16_t *scales, const uint16_t *bias, {_PROJECTION}, "
            "const uint16_t *x, int64_t rows, uint16_t *out, int num_threads"
        ),
        requires=Requires.VECTOR_BF16,
    ),
    Kernel(
        "ft_decode_step",
        _parameters("const DecodeModel *model, const DecodeBatch *batch, uint16_t *hidden, int num_threads"),
        requires=Requires.VECTOR_BF16,
    ),
    Kernel("ft_paged_decode_attention", _parameters(_BF16_PAGED_DECODES), requires=Requires.VECTOR_BF16),
    Kernel(
        "ft_logits_packed_elements",
        _parameters("int64_t vocab, int64_t hidden"),
        result="int64_t",
        requires=Requires.VECTOR_BF16,
    ),
    Kernel(
        "ft_pack_logits_weight",
        _parameters("const uint16_t *weight, int64_t vocab, int64_t hidden, uint16_t *packed"),
        requires=Requires.VECTOR_BF16,
    ),
    Kernel(
        "ft_bf16_logits",
        _parameters(
            "const uint16_t *x, const uint16_t *packed, int64_t rows, int64_t vocab, int64_t hidden, "
            "float *out, int num_threads, int use_amx"
        ),
        requires=Requires.VECTOR_BF16,
    ),
    Kernel(
        "ft_decode_attention_as_prefill",
        _parameters(f"{_BF16_PAGED_DECODES}, int64_t window, float softcap, int use_amx"),
        requires=Requires.VECTOR_BF16,
    ),
)


def _c_member(name: str, c_type: CType) -> str:
    type_text = c_type.__name__ if isinstance(c_type, type) else c_type
    separator = "" if type_text.endswith("*") else " "
    return f"    {type_text}{separator}{name};"


def _c_typedef(struct: type[ctypes.Structure]) -> str:
    members = "\n".join(_c_member(name, c_type) for name, c_type in struct.c_fields)
    return f"typedef struct {{\n{members}\n}} {struct.__name__};"


def _c_status_enum() -> str:
    members = "\n".join(f"    FT_{status.name} = {status.value}," for status in Status)
    return f"typedef enum {{\n{members}\n}} FtStatus;"


def _c_prototype(kernel: Kernel) -> str:
    parameters = ", ".join(_c_member(name, c_type).strip().rstrip(";") for name, c_type in kernel.parameters)
    separator = "" if kernel.result.endswith("*") else " "
    return f"{kernel.result}{separator}{kernel.name}({parameters or 'void'});"


def c_header() -> str:
    """native_abi.h: the constants as macros, the status codes as an enum, the shared structs as
    typedefs and every kernel's prototype."""
    return "\n".join(
        [
            "/* Written at build time from firsttoken/ops/native_abi.py: edit that file, not this one. */",
            "#ifndef FIRSTTOKEN_NATIVE_ABI_H",
            "#define FIRSTTOKEN_NATIVE_ABI_H",
            "#include <stdint.h>",
            *(f"#define {name} {value}" for name, value in _C_CONSTANTS.items()),
            _c_status_enum(),
            *(_c_typedef(struct) for struct in _SHARED_STRUCTS),
            *(_c_prototype(kernel) for kernel in KERNELS),
            "#endif",
            "",
        ]
    )
