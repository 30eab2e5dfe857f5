"""The portable flash attention (csrc/attention.c) against the torch paths it replaces, in turns.

    python benchmarks/cpu_attention.py [--isa avx2 avx512] [--dtype float32] [--threads 2]
        [--lengths 128 512 2048] [--contexts 512 2048] [--repeats 20]

SmolLM2-135M's attention shapes (9 query heads, 3 KV heads, head size 64), for each ISA asked
for (built side by side, `auto` = this CPU):
1. Causal prefill of n tokens: SDPA's causal flash kernel (the float32 path today) against
   `flash_attention`.
2. A chunk of 32 new tokens on n cached ones, its context in scattered blocks of 16: SDPA over
   the gathered context plus SDPA over the new tokens, merged (today's path), against
   `flash_attention_paged` (reads the blocks in place).
3. Decode rows (1 and 4 sequences) over n tokens of context in scattered blocks: the padded
   gather and masked SDPA (today's path), against `flash_decode_attention`.
Medians of `--repeats` calls in turns, microseconds, and the ratio torch / ours (> 1: ours faster).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import print_table  # noqa: E402
from native_kernels import call_medians  # noqa: E402

from firsttoken.attention.backend import BatchLayout, SequenceLayout  # noqa: E402
from firsttoken.attention.cpu_backend import (  # noqa: E402
    CPUAttentionBackend,
    PrefillSpan,
    _decode_attention,
    _prefill_attention,
)
from firsttoken.models.loaders.conversion_cache import default_cache_dir  # noqa: E402
from firsttoken.ops.cpu_isa import runnable_cpu_isas  # noqa: E402
from firsttoken.ops.native import NativeKernels, load_native_kernels  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 9, 3, 64
BLOCK_SIZE = 16
CHUNK_TOKENS = 32


def qkv_views(num_tokens: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Query, key and value as strided views of one qkv projection, as the model holds them."""
    qkv = torch.randn(num_tokens, (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM).to(dtype)
    query = qkv[:, : NUM_HEADS * HEAD_DIM].view(num_tokens, NUM_HEADS, HEAD_DIM)
    key = qkv[:, NUM_HEADS * HEAD_DIM : (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM].view(
        num_tokens, NUM_KV_HEADS, HEAD_DIM
    )
    value = qkv[:, (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM :].view(num_tokens, NUM_KV_HEADS, HEAD_DIM)
    return query, key, value


def scattered_cache(
    sequence_lengths: list[int], dtype: torch.dtype
) -> tuple[torch.Tensor, list[list[int]]]:
    """A random paged cache holding the sequences in shuffled blocks, and their block tables."""
    blocks_needed = [-(-length // BLOCK_SIZE) for length in sequence_lengths]
    num_blocks = sum(blocks_needed)
    kv_cache = torch.randn(2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM).to(dtype)
    order = torch.randperm(num_blocks).tolist()
    tables, cursor = [], 0
    for needed in blocks_needed:
        tables.append(order[cursor : cursor + needed])
        cursor += needed
    return kv_cache, tables


def prefill_row(native: NativeKernels, num_tokens: int, dtype: torch.dtype, threads: int) -> list[object]:
    query, key, value = qkv_views(num_tokens, dtype)
    span = PrefillSpan(0, num_tokens, 0, None)
    medians = call_medians(
        {
            "sdpa": lambda: _prefill_attention(query, key, value, torch.empty(0), span),
            "ours": lambda: native.flash.flash_attention(query, key, value, threads),
        }
    )
    return ["prefill", num_tokens, medians["sdpa"], medians["ours"], medians["sdpa"] / medians["ours"]]


def chunk_row(native: NativeKernels, num_context: int, dtype: torch.dtype, threads: int) -> list[object]:
    num_keys = num_context + CHUNK_TOKENS
    kv_cache, (table,) = scattered_cache([num_keys], dtype)
    block_ids = torch.tensor(table)
    query, key, value = qkv_views(CHUNK_TOKENS, dtype)
    span = PrefillSpan(0, CHUNK_TOKENS, num_context, None, None, block_ids)
    medians = call_medians(
        {
            "sdpa": lambda: _prefill_attention(query, key, value, kv_cache, span),
            "ours": lambda: native.flash.flash_attention_paged(query, kv_cache, block_ids, num_keys, threads),
        }
    )
    label = f"chunk {CHUNK_TOKENS} on"
    return [label, num_context, medians["sdpa"], medians["ours"], medians["sdpa"] / medians["ours"]]


def decode_row(native: NativeKernels, num_context: int, rows: int, dtype: torch.dtype) -> list[object]:
    lengths = [num_context + 1 + r for r in range(rows)]  # a little different, as in a real batch
    kv_cache, tables = scattered_cache(lengths, dtype)
    layout = BatchLayout(
        [SequenceLayout(1, length - 1, table) for length, table in zip(lengths, tables)], rows, BLOCK_SIZE
    )
    slot_mapping = torch.tensor([table[(length - 1) // BLOCK_SIZE] * BLOCK_SIZE + (length - 1) % BLOCK_SIZE
                                 for length, table in zip(lengths, tables)])
    query = torch.randn(rows, NUM_HEADS, HEAD_DIM).to(dtype)
    torch_backend = CPUAttentionBackend(torch.device("cpu"))
    torch_metadata = torch_backend.build_metadata(layout, slot_mapping)
    ours = CPUAttentionBackend(torch.device("cpu"), native).build_metadata(layout, slot_mapping).paged_decodes
    medians = call_medians(
        {
            "sdpa": lambda: _decode_attention(query, kv_cache, torch_metadata, window=None),
            "ours": lambda: native.flash.flash_decode_attention(
                query, kv_cache, ours.block_table, ours.seq_lens
            ),
        }
    )
    return [
        f"decode x{rows} over",
        num_context,
        medians["sdpa"],
        medians["ours"],
        medians["sdpa"] / medians["ours"],
    ]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--isa", nargs="+", default=["auto"], choices=["auto", *runnable_cpu_isas()])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    for isa in args.isa:
        native = load_native_kernels(os.path.join(default_cache_dir(), "native"), isa)
        if native is None:
            sys.exit("no working C compiler: the native kernels could not be built")
        print(f"\n{isa} build ({native.isa}), {args.dtype}, {args.threads} threads; microseconds, medians")
        rows = [prefill_row(native, length, dtype, args.threads) for length in args.lengths]
        rows += [chunk_row(native, context, dtype, args.threads) for context in args.contexts]
        rows += [decode_row(native, context, batch, dtype) for context in args.contexts for batch in (1, 4)]
        print_table(["case", "tokens", "torch us", "ours us", "torch / ours"], rows)


if __name__ == "__main__":
    main()
