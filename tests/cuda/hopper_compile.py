"""Compile the CUDA path's Triton kernels for a Hopper GPU (PTX and cubin) without one.

Run as `python -m tests.cuda.hopper_compile` in a process without `TRITON_INTERPRET` (the
interpreter patches triton.language for the whole process); prints one line per kernel.
"""

from __future__ import annotations

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from firsttoken.attention import triton_kernels
from firsttoken.ops import triton_matmul

HOPPER = GPUTarget("cuda", 90, 32)


def _compile(kernel, signature: dict[str, str], constexprs: dict[str, object]):
    source = ASTSource(kernel, signature | dict.fromkeys(constexprs, "constexpr"), constexprs)
    return triton.compile(source, target=HOPPER)


def compile_matmul():
    tiles = triton_matmul.matmul_tiles(576, 576, torch.bfloat16)
    signature = {
        "x_ptr": "*bf16",
        "weight_ptr": "*bf16",
        "bias_ptr": "*bf16",
        "out_ptr": "*bf16",
        "num_rows": "i32",
    }
    constexprs = {
        "N": 576,
        "K": 576,
        "BLOCK_M": triton_matmul.BLOCK_M,
        "BLOCK_N": tiles.block_n,
        "BLOCK_K": tiles.block_k,
        "HAS_BIAS": True,
        "DOT_PRECISION": "tf32",
    }
    return _compile(triton_matmul._matmul_kernel, signature, constexprs)


def compile_attention(windowed: bool = False, softcapped: bool = False, sink_tokens: int = 0):
    strides = [
        "stride_query_token",
        "stride_query_head",
        "stride_sink_query_token",
        "stride_sink_query_head",
        "stride_output_token",
        "stride_output_head",
        "stride_cache_kv",
        "stride_cache_block",
        "stride_cache_offset",
        "stride_cache_head",
        "stride_table_seq",
    ]
    signature = {
        "output_ptr": "*bf16", "query_ptr": "*bf16", "sink_query_ptr": "*bf16", "cache_ptr": "*bf16",
        "block_tables_ptr": "*i32", "queries_ptr": "*i32", "one_token_per_seq": "i32", "scale_log2": "fp32",
        "window": "i32", "softcap_exp2_scale": "fp32", "softcap_log2": "fp32",
    } | dict.fromkeys(strides, "i32")
    tile = triton_kernels.prefill_tile_shape(3)
    constexprs = {
        "BLOCK_SIZE": 16, "GROUP": 3, "HEAD_DIM": 64, "HEAD_DIM_PAD": 64, "TILE_TOKENS": tile.query_tokens,
        "TILE_ROWS": tile.rows, "KEYS_PER_TILE": triton_kernels.KEYS_PER_TILE, "DOT_PRECISION": "tf32",
        "WINDOWED": windowed, "SOFTCAPPED": softcapped, "SINK_TOKENS": sink_tokens,
    }
    return _compile(triton_kernels._paged_attention_kernel, signature, constexprs)


def compile_layer_attention():
    """The paged kernel with a window, soft-capped scores and StreamingLLM sinks."""
    return compile_attention(windowed=True, softcapped=True, sink_tokens=4)


def main() -> None:
    kernels = (
        ("matmul", compile_matmul),
        ("attention", compile_attention),
        ("attention with window, soft-cap and sinks", compile_layer_attention),
    )
    for name, compile_kernel in kernels:
        compiled = compile_kernel()
        ptx = compiled.asm["ptx"]
        print(f"{name}: cubin {len(compiled.asm['cubin'])} bytes, wgmma {'wgmma' in ptx}")


if __name__ == "__main__":
    main()
