"""Attention of a prefill chunk on cached context held in scattered KV blocks, the usual case
under load (freed blocks are reused in any order), one layer of SmolLM2-135M's shape (9 query
heads, 3 KV heads, head size 64, bf16), in one process, in turns:

- native: the SDPA backend as it runs now, one gather of the sequence's blocks and the native
  causal prefill kernel;
- split: what it ran before, SDPA over the context with its log-sum-exp, SDPA over the chunk,
  then a merge of the two.

    python benchmarks/chunk_attention.py [--shapes 512:128 1024:256 2048:512] [--repeats 15]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import interleaved_medians, print_table, save_result, timed  # noqa: E402

from firsttoken.attention.backend import PLAIN_ATTENTION, BatchLayout, SequenceLayout  # noqa: E402
from firsttoken.attention.reference import write_kv_reference  # noqa: E402
from firsttoken.attention.cpu_backend import CPUAttentionBackend, _FlashOptions, _prefill_attention  # noqa: E402
from firsttoken.models.loaders.conversion_cache import default_cache_dir  # noqa: E402
from firsttoken.ops.native import load_native_kernels  # noqa: E402

BLOCK_SIZE, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 16, 9, 3, 64


def scattered_chunk(num_context: int, num_queries: int, seed: int):
    """A chunk's query/key/value and a cache holding its context in shuffled blocks."""
    generator = torch.Generator().manual_seed(seed)
    num_blocks = -(-(num_context + num_queries) // BLOCK_SIZE)
    block_table = torch.randperm(num_blocks, generator=generator).tolist()
    cache = torch.zeros(2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=torch.bfloat16)
    positions = torch.arange(num_context + num_queries)
    slots = torch.tensor(block_table)[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(torch.bfloat16)

    context_keys, context_values = (
        randn(num_context, NUM_KV_HEADS, HEAD_DIM),
        randn(num_context, NUM_KV_HEADS, HEAD_DIM),
    )
    write_kv_reference(cache, context_keys, context_values, slots[:num_context])
    query = randn(num_queries, NUM_HEADS, HEAD_DIM)
    key, value = randn(num_queries, NUM_KV_HEADS, HEAD_DIM), randn(num_queries, NUM_KV_HEADS, HEAD_DIM)
    layout = BatchLayout([SequenceLayout(num_queries, num_context, block_table)], 0, BLOCK_SIZE)
    return layout, slots[num_context:], cache, query, key, value


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--shapes", nargs="+", default=["512:128", "1024:256", "2048:512"], help="context:chunk tokens"
    )
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    native = load_native_kernels(os.path.join(default_cache_dir(), "native"))
    if native is None or not native.attention.has_prefill_attention:
        sys.exit("needs the native prefill attention (a C compiler and a CPU with AVX512-BF16 or AMX)")
    backend = CPUAttentionBackend(torch.device("cpu"), native)
    rows, payload = [], []
    for shape in args.shapes:
        num_context, num_queries = (int(part) for part in shape.split(":"))
        layout, slots, cache, query, key, value = scattered_chunk(num_context, num_queries, seed=num_context)
        metadata = backend.build_metadata(layout, slots)
        backend.forward(query, key, value, cache, metadata)  # writes the chunk's K/V
        span = metadata.prefills[0]
        plain = _FlashOptions(PLAIN_ATTENTION, sink_query=None)
        out = torch.empty(query.shape, dtype=query.dtype)

        def native_chunk() -> None:
            backend._prefill(query, key, value, cache, span, plain, out)

        medians = interleaved_medians(
            {
                "native": lambda _: timed(native_chunk),
                "split": lambda _: timed(lambda: _prefill_attention(query, key, value, cache, span)),
            },
            args.repeats,
        )
        ratio = medians["native"] / medians["split"]
        rows.append([num_context, num_queries, medians["native"] * 1e3, medians["split"] * 1e3, ratio])
        payload.append({"context": num_context, "chunk": num_queries, **medians, "ratio": ratio})
    print(f"torch threads {torch.get_num_threads()}, medians of {args.repeats} calls in turns")
    print_table(["context", "chunk", "native ms", "split ms", "native / split"], rows)
    print(f"saved {save_result('chunk_attention', {'shapes': payload})}")


if __name__ == "__main__":
    main()
