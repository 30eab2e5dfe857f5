"""What Python and the compiled kernels (csrc/) must agree on, declared once for both sides.

The kernels' limits, their dtype codes and the structs the decode step reads are defined
here only: the build (`native.py`) writes `c_header()` into the build folder as
native_abi.h, which csrc/common.h includes, and Python fills the ctypes classes below. A
constant or a field cannot change on one side alone; the header's text is part of the
build's cache key, so a change rebuilds.
"""

from __future__ import annotations

import ctypes

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
# The `dtype` argument of the kernels that take either (bf16 as its raw uint16 bits).
DTYPE_FLOAT32 = 0
DTYPE_BFLOAT16 = 1

_C_CONSTANTS = {
    "DECODE_MAX_ROWS": DECODE_MAX_ROWS,
    "DECODE_MAX_HEAD_DIM": DECODE_MAX_HEAD_DIM,
    "PREFILL_MAX_HEAD_DIM": PREFILL_MAX_HEAD_DIM,
    "ATTENTION_MAX_HEAD_DIM": ATTENTION_MAX_HEAD_DIM,
    "DTYPE_FLOAT32": DTYPE_FLOAT32,
    "DTYPE_BFLOAT16": DTYPE_BFLOAT16,
}

# A field's C type: scalar text ("int64_t"), pointer text ("const uint16_t *": a c_void_p in
# Python, which passes tensors' data_ptr()), or another struct of this module, held by value.
CType = str | type[ctypes.Structure]
_C_SCALARS = {"int64_t": ctypes.c_int64, "float": ctypes.c_float}


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
    """An int4 projection in the layout of `firsttoken.ops.linear.pack_int4`."""

    c_fields: tuple[tuple[str, CType], ...] = (
        ("levels", "const uint8_t *"),  # [out, in / 2]
        ("scales_zeros", "const uint16_t *"),  # bf16 [out, 2 * in / 32]: a row's group scales, then its zeros
        ("bias", "const uint16_t *"),  # bf16 [out], or NULL
        ("out_features", "int64_t"),
        ("in_features", "int64_t"),
    )


@_shared_struct
class DecodeLayer(ctypes.Structure):
    """One decoder layer's weights and KV cache."""

    c_fields: tuple[tuple[str, CType], ...] = (
        ("input_norm", "const uint16_t *"),  # bf16 [hidden]
        ("post_attention_norm", "const uint16_t *"),  # bf16 [hidden]
        ("qkv", Int4Weight),
        ("o", Int4Weight),
        ("gate_up", Int4Weight),
        ("down", Int4Weight),
        ("kv_cache", "uint16_t *"),  # bf16 [2, num_slots, kv_heads * head_dim]
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
        ("cos", "const uint16_t *"),  # bf16 [num_sequences, head_dim]
        ("sin", "const uint16_t *"),  # bf16 [num_sequences, head_dim]
    )


# In declaration order: a struct follows those it holds.
_SHARED_STRUCTS = (Int4Weight, DecodeLayer, DecodeModel, DecodeBatch)


def _c_member(name: str, c_type: CType) -> str:
    type_text = c_type.__name__ if isinstance(c_type, type) else c_type
    separator = "" if type_text.endswith("*") else " "
    return f"    {type_text}{separator}{name};"


def _c_typedef(struct: type[ctypes.Structure]) -> str:
    members = "\n".join(_c_member(name, c_type) for name, c_type in struct.c_fields)
    return f"typedef struct {{\n{members}\n}} {struct.__name__};"


def c_header() -> str:
    """native_abi.h: the constants as macros and the shared structs as typedefs."""
    return "\n".join(
        [
            "/* Written at build time from firsttoken/ops/native_abi.py: edit that file, not this one. */",
            "#ifndef FIRSTTOKEN_NATIVE_ABI_H",
            "#define FIRSTTOKEN_NATIVE_ABI_H",
            "#include <stdint.h>",
            *(f"#define {name} {value}" for name, value in _C_CONSTANTS.items()),
            *(_c_typedef(struct) for struct in _SHARED_STRUCTS),
            "#endif",
            "",
        ]
    )
