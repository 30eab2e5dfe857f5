"""What one run of the device check (gpu_check.py) measures: the Llama-family shapes it seeds
models of, and its plans of prompt lengths, batch sizes and dtype, the full one for a GPU and a
tiny one for the CPU smoke run."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Shape:
    """A Llama-family model shape; weights come from a seed."""

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    max_position_embeddings: int
    rope_theta: float
    tie_word_embeddings: bool

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype.itemsize  # K and V

    def forward_flops(self, num_tokens: int) -> float:
        """A prefill of `num_tokens`: every projection, causal attention, the LM head on one row."""
        q_size, kv_size = self.hidden_size, self.num_kv_heads * self.head_dim
        per_token = self.num_layers * (
            self.hidden_size * (q_size + 2 * kv_size)
            + q_size * self.hidden_size
            + 3 * self.hidden_size * self.intermediate_size
        )
        attention_pairs = num_tokens * (num_tokens + 1) / 2
        return (
            2 * per_token * num_tokens
            + 4 * q_size * self.num_layers * attention_pairs
            + 2 * self.hidden_size * self.vocab_size
        )


SMOLLM2_135M = Shape("smollm2-135m", 49152, 576, 1536, 30, 9, 3, 8192, 100000.0, True)
# Llama-2-7B's layers, with the context stretched past the 8192-token TTFT point.
LLAMA2_7B = Shape("llama2-7b", 32000, 4096, 11008, 32, 32, 32, 8192 + 256, 10000.0, False)
TINY_GQA = Shape("tiny-gqa", 512, 64, 128, 2, 4, 2, 1024, 10000.0, True)
TINY_MHA = Shape("tiny-mha", 512, 96, 192, 3, 3, 3, 1024, 10000.0, False)


@dataclass(frozen=True)
class Plan:
    """What one run measures; the full plan for a GPU, a tiny one for the CPU smoke run."""

    shapes: tuple[Shape, ...]
    ttft_lengths: tuple[int, ...]  # for every shape, those below its context length
    parity_lengths: tuple[int, ...]
    parity_new_tokens: int
    decode_batches: tuple[int, ...]
    decode_prompt_tokens: int
    decode_new_tokens: int
    matmul_size: int
    dtype: torch.dtype
    invariance_lengths: tuple[int, ...]  # TTFT with batch_invariant on and off
    invariance_new_tokens: int  # tokens whose log-prob bits are compared alone and beside others


FULL_PLAN = Plan(
    shapes=(SMOLLM2_135M, LLAMA2_7B),
    ttft_lengths=(128, 512, 2048, 8192),
    parity_lengths=(7, 300, 777),
    parity_new_tokens=24,
    decode_batches=(1, 16),
    decode_prompt_tokens=128,
    decode_new_tokens=64,
    matmul_size=8192,
    dtype=torch.bfloat16,
    invariance_lengths=(128, 512, 2048),
    invariance_new_tokens=8,
)
TINY_PLAN = Plan(
    shapes=(TINY_GQA, TINY_MHA),
    ttft_lengths=(16, 64, 256),
    parity_lengths=(7, 40, 77),
    parity_new_tokens=8,
    decode_batches=(1, 16),
    decode_prompt_tokens=16,
    decode_new_tokens=8,
    matmul_size=256,
    dtype=torch.float32,
    invariance_lengths=(16, 64),
    invariance_new_tokens=4,
)
