"""What every whole-step native call takes besides its weights: the layer's dimensions, and the
paged addressing of the step's decode rows (also read by the attention backends' paged decode)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DecodeTables:
    """The decode rows' paged addressing as tensors: where each new key goes, and every key each
    row attends over."""

    slot_mapping: torch.Tensor  # long [B]
    block_table: torch.Tensor  # long [B, max_blocks], short rows padded with block 0
    seq_lens: torch.Tensor  # long [B]: keys each sequence attends over, its new one included


@dataclass(frozen=True)
class LayerShape:
    """The dimensions of the Llama layer a whole-step native call runs (the int4 decode, the W8A8
    step)."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float

    def model_fields(self, num_layers: int, kv_cache: torch.Tensor) -> tuple[int | float, ...]:
        """The leading fields of both native step models (DecodeModel, W8A8StepModel), in their
        order: the layer count, these dimensions, the cache's slots, the norm's epsilon and the
        attention scale (head_dim ** -0.5, as the attention kernels' wrappers pass it)."""
        num_slots = kv_cache.shape[1] * kv_cache.shape[2]
        return (
            num_layers, self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim,
            self.intermediate_size, num_slots, self.rms_norm_eps, self.head_dim**-0.5,
        )
