"""The Llama-family model (Llama 2/3, SmolLM, Mistral, Phi-3, Qwen2/3, Gemma 3) over a flattened,
paged batch.

forward(input_ids, positions, attn_metadata) runs every token of a step (many requests,
prefilling and decoding) as one [T, hidden] batch with no padding; compute_logits runs the
final norm and LM head only on the rows that sample a token. Q/K/V and gate/up projections
are single fused matrices, built at load time.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from firsttoken.attention.backend import AttentionBackend, LayerAttention
from firsttoken.models.arch import ModelArch
from firsttoken.models.sharding import (
    Collectives,
    ModelShard,
    RowParallelLinear,
    gate_up_rows,
    gather_vocab_logits,
    qkv_rows,
    vocab_parallel_embedding,
)
from firsttoken.ops.kernels import Kernels
from firsttoken.ops.hadamard import HadamardInputs
from firsttoken.ops.linear import (
    Linear,
    PackedLinear,
    native_row_invariant_available,
    replace_linears,
    row_invariant_linear,
)
from firsttoken.ops.decode_batch_linear import convert_decode_batches
from firsttoken.ops.linear_choice import convert_linears, fastest_linear, head_linear
from firsttoken.ops.rotary import cos_sin_table, inverse_frequencies, partial_rotary_order, rotary_cos_sin
from firsttoken.ops.w8a8 import Int8Weight
from firsttoken.ops.w8a8_linear import PendingNorm, W8A8Linear


def _empty(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class LlamaAttention(nn.Module):
    """Fused QKV projection, rotary embedding, paged attention and output projection."""

    def __init__(
        self,
        arch: ModelArch,
        backend: AttentionBackend,
        kernels: Kernels,
        dtype: torch.dtype,
        layer_attention: LayerAttention,
    ) -> None:
        super().__init__()
        self.kernels = kernels
        self.layer_attention = layer_attention
        # Gemma's score scale, folded into the queries: the kernels scale by head_dim ** -0.5.
        self.query_multiplier = (
            arch.attention_scale / arch.head_dim**-0.5 if arch.attention_scale is not None else None
        )
        self.num_heads = arch.num_heads
        self.num_kv_heads = arch.num_kv_heads
        self.head_dim = arch.head_dim
        self.q_size = arch.q_size
        self.kv_size = arch.kv_size
        self.qkv_proj = Linear(arch.hidden_size, arch.q_size + 2 * arch.kv_size, arch.attention_bias, dtype)
        self.o_proj = Linear(arch.q_size, arch.hidden_size, arch.attention_output_bias, dtype)
        self.eps = arch.rms_norm_eps
        if arch.qk_norm:
            self.q_norm_weight = _empty(arch.head_dim, dtype=dtype)
            self.k_norm_weight = _empty(arch.head_dim, dtype=dtype)
        else:
            self.q_norm_weight = self.k_norm_weight = None
        self.backend = backend
        self.kv_cache: torch.Tensor | None = None  # [2, blocks, block_size, kv_heads, D], bound later

    def shard(self, shard: ModelShard, arch: ModelArch, collectives: Collectives) -> None:
        """Keep this rank's heads: their rows of QKV, their columns of the output projection."""
        self.num_heads, self.num_kv_heads = shard.num_heads, shard.num_kv_heads
        self.q_size, self.kv_size = shard.num_heads * self.head_dim, shard.num_kv_heads * self.head_dim
        self.qkv_proj = _rows_of(self.qkv_proj, qkv_rows(shard, arch))
        q_start, q_end = shard.head_range
        self.o_proj = RowParallelLinear(
            _columns_of(self.o_proj, q_start * self.head_dim, q_end * self.head_dim, shard.rank == 0),
            collectives,
        )

    def forward(
        self,
        hidden: torch.Tensor | PendingNorm,
        rotary: tuple[torch.Tensor, torch.Tensor],
        attn_metadata: Any,
        sink_rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """`hidden` a PendingNorm where qkv_proj runs the norm before it (W8A8). `sink_rotary`
        (StreamingLLM): cos and sin at each token's position in the sinks-plus-window cache, which
        rotate the sink queries."""
        qkv = self.qkv_proj(hidden)  # [T, q + 2 kv]
        num_tokens = qkv.shape[0]
        # Queries and keys are rotated together: one pass over their heads.
        if self.q_norm_weight is None:
            query_key = qkv[:, : self.q_size + self.kv_size].view(
                num_tokens, self.num_heads + self.num_kv_heads, self.head_dim
            )
        else:
            query_key = self._normed_query_key(qkv)
        sink_query = None
        if sink_rotary is not None:
            # A copy (contiguous() of one row is no copy), rotated before the rotary below, which
            # may rotate query_key in place.
            unrotated = query_key[:, : self.num_heads].clone(memory_format=torch.contiguous_format)
            sink_query = self.kernels.apply_rotary(unrotated, *sink_rotary)
        query_key = self.kernels.apply_rotary(query_key, *rotary)
        query, key = query_key.split([self.num_heads, self.num_kv_heads], dim=1)
        if self.query_multiplier is not None:
            query = query * self.query_multiplier
            sink_query = sink_query * self.query_multiplier if sink_query is not None else None
        value = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        attended = self.backend.forward(
            query, key, value, self.kv_cache, attn_metadata, self.layer_attention, sink_query
        )
        return self.o_proj(attended.reshape(num_tokens, self.q_size))

    def _normed_query_key(self, qkv: torch.Tensor) -> torch.Tensor:
        """[T, heads + kv_heads, head_dim]: each query head and key head RMS-normalized with its
        own weight (Qwen3), as one row per head."""
        num_tokens = qkv.shape[0]
        queries = self.kernels.rms_norm(
            qkv[:, : self.q_size].reshape(-1, self.head_dim), self.q_norm_weight, self.eps
        )
        keys = self.kernels.rms_norm(
            qkv[:, self.q_size : self.q_size + self.kv_size].reshape(-1, self.head_dim),
            self.k_norm_weight,
            self.eps,
        )
        return torch.cat(
            [
                queries.view(num_tokens, self.num_heads, self.head_dim),
                keys.view(num_tokens, self.num_kv_heads, self.head_dim),
            ],
            dim=1,
        )


class LlamaMLP(nn.Module):
    """SwiGLU (GeGLU for Gemma) with the gate and up projections fused into one matrix."""

    def __init__(self, arch: ModelArch, kernels: Kernels, dtype: torch.dtype) -> None:
        super().__init__()
        self.kernels = kernels
        self.silu_gated = arch.hidden_activation != "gelu_tanh"
        self.activation_and_mul = kernels.silu_and_mul if self.silu_gated else kernels.gelu_tanh_and_mul
        self.gate_up_proj = Linear(arch.hidden_size, 2 * arch.intermediate_size, arch.mlp_bias, dtype)
        self.down_proj = Linear(arch.intermediate_size, arch.hidden_size, arch.mlp_bias, dtype)

    def shard(self, shard: ModelShard, arch: ModelArch, collectives: Collectives) -> None:
        """Keep this rank's slice of the intermediate features."""
        self.gate_up_proj = _rows_of(self.gate_up_proj, gate_up_rows(shard, arch))
        self.down_proj = RowParallelLinear(
            _columns_of(self.down_proj, *shard.intermediate_range, shard.rank == 0), collectives
        )

    def forward(self, hidden: torch.Tensor | PendingNorm) -> torch.Tensor:
        """`hidden` a PendingNorm where gate_up_proj runs the norm before it (W8A8)."""
        if isinstance(self.gate_up_proj, W8A8Linear) and self.gate_up_proj.makes_swiglu_product:
            # W8A8's int8 matmul stores SwiGLU's product from its epilogue: gate | up is never written.
            return self.down_proj(self.gate_up_proj(hidden))
        gate_up = self.gate_up_proj(hidden)
        if (
            self.silu_gated
            and isinstance(self.down_proj, W8A8Linear)
            and self.down_proj.takes_silu_gated_inputs
        ):
            # W8A8 quantizes down_proj's inputs in one native pass: SwiGLU's product is made there.
            return self.down_proj.forward_silu_gated(gate_up)
        return self.down_proj(self.activation_and_mul(gate_up))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block (Gemma: sandwich, the attention's and the MLP's outputs normed too before
    their residual adds); the residual add is fused into the next norm."""

    def __init__(
        self,
        arch: ModelArch,
        backend: AttentionBackend,
        kernels: Kernels,
        dtype: torch.dtype,
        layer_attention: LayerAttention,
        local_rotary: bool,
    ) -> None:
        super().__init__()
        self.kernels = kernels
        self.eps = arch.rms_norm_eps
        self.input_norm_weight = _empty(arch.hidden_size, dtype=dtype)
        # Before the MLP (Hugging Face's post_attention_layernorm; Gemma's pre_feedforward_layernorm).
        self.post_attention_norm_weight = _empty(arch.hidden_size, dtype=dtype)
        if arch.sandwich_norms:
            self.attention_output_norm_weight = _empty(arch.hidden_size, dtype=dtype)
            self.mlp_output_norm_weight = _empty(arch.hidden_size, dtype=dtype)
        else:
            self.attention_output_norm_weight = self.mlp_output_norm_weight = None
        # Gemma 3's windowed layers rotate by their own base.
        self.local_rotary = local_rotary
        self.self_attn = LlamaAttention(arch, backend, kernels, dtype, layer_attention)
        self.mlp = LlamaMLP(arch, kernels, dtype)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rotary: tuple[torch.Tensor, torch.Tensor],
        attn_metadata: Any,
        sink_rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        normed, residual = self._norm_for(self.self_attn.qkv_proj, hidden, residual, self.input_norm_weight)
        hidden = self.self_attn(normed, rotary, attn_metadata, sink_rotary)
        residual = _residual_after(normed, residual)
        if self.attention_output_norm_weight is not None:
            hidden = self.kernels.rms_norm(hidden, self.attention_output_norm_weight, self.eps)
        normed, residual = self._norm_for(
            self.mlp.gate_up_proj, hidden, residual, self.post_attention_norm_weight
        )
        hidden = self.mlp(normed)
        residual = _residual_after(normed, residual)
        if self.mlp_output_norm_weight is not None:
            hidden = self.kernels.rms_norm(hidden, self.mlp_output_norm_weight, self.eps)
        return hidden, residual

    def _norm_for(
        self, projection: nn.Module, hidden: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor
    ) -> tuple[torch.Tensor | PendingNorm, torch.Tensor | None]:
        """The RMSNorm before `projection`, after adding the residual where there is one: (its
        rows, the new residual). A W8A8 projection runs the norm in its own call: (the norm
        pending, None), the new residual left in the norm's `summed` once the projection ran."""
        if isinstance(projection, W8A8Linear) and projection.takes_normed_rows(hidden, residual, weight):
            return PendingNorm(hidden, residual, weight, self.eps), None
        if residual is None:
            return self.kernels.rms_norm(hidden, weight, self.eps), hidden
        return self.kernels.add_rms_norm(hidden, residual, weight, self.eps)


def _residual_after(normed: torch.Tensor | PendingNorm, residual: torch.Tensor | None) -> torch.Tensor | None:
    """The residual after a norm and the projection that took its rows: the projection's doing
    where it ran the norm (a PendingNorm), else the norm's own."""
    if isinstance(normed, PendingNorm):
        if normed.summed is None:
            raise RuntimeError("a W8A8 projection took a pending norm without running it")
        return normed.summed
    return residual


class LlamaForCausalLM(nn.Module):
    """Embedding, decoder layers, final norm and (possibly tied) LM head.

    With `streaming_window` (StreamingLLM), every layer's queries see the first `sink_tokens`
    keys and the last `streaming_window` (or the layer's own window, if narrower)."""

    def __init__(
        self,
        arch: ModelArch,
        backend: AttentionBackend,
        kernels: Kernels,
        dtype: torch.dtype,
        max_positions: int,
        rope_frequency_divisors: torch.Tensor | None = None,
        streaming_window: int | None = None,
        sink_tokens: int = 0,
    ) -> None:
        super().__init__()
        self.arch = arch
        self.kernels = kernels
        self.embed_weight = _empty(arch.vocab_size, arch.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(
                arch,
                backend,
                kernels,
                dtype,
                layer_attention_of(arch, index, max_positions, streaming_window, sink_tokens),
                arch.local_rope_theta is not None and arch.is_windowed(index),
            )
            for index in range(arch.num_layers)
        )
        self.norm_weight = _empty(arch.hidden_size, dtype=dtype)
        self.lm_head = Linear(arch.hidden_size, arch.vocab_size, False, dtype)
        if arch.tie_word_embeddings:
            self.lm_head.weight = self.embed_weight
        inv_freq = inverse_frequencies(
            arch.rotated_dims, arch.rope_theta, arch.rope_scaling, rope_frequency_divisors, max_positions
        )
        attention_factor = arch.rope_scaling.attention_factor if arch.rope_scaling is not None else 1.0
        table = cos_sin_table(inv_freq, max_positions, arch.head_dim, attention_factor)
        self.register_buffer("rope_table", table, persistent=False)
        if arch.local_rope_theta is not None:
            local_inv_freq = inverse_frequencies(arch.rotated_dims, arch.local_rope_theta, None, None)
            local_table = cos_sin_table(local_inv_freq, max_positions, arch.head_dim)
            self.register_buffer("local_rope_table", local_table, persistent=False)
        else:
            self.local_rope_table = None
        # Set by shard(): this rank's slices, and the process group that joins them.
        self.tensor_shard: ModelShard | None = None
        self.collectives: Collectives | None = None

    def shard(self, shard: ModelShard, collectives: Collectives) -> None:
        """Keep only rank `shard.rank`'s slices of the loaded weights (call before
        `prepare_projections`). Row-parallel projections then sum over the ranks."""
        for layer in self.layers:
            layer.self_attn.shard(shard, self.arch, collectives)
            layer.mlp.shard(shard, self.arch, collectives)
        vocab_start, vocab_end = shard.vocab_range
        tied = self.lm_head.weight is self.embed_weight
        self.embed_weight = nn.Parameter(
            self.embed_weight.data[vocab_start:vocab_end].clone(), requires_grad=False
        )
        if tied:
            self.lm_head.weight = self.embed_weight
        else:
            self.lm_head = _rows_of(self.lm_head, torch.arange(vocab_start, vocab_end))
        self.tensor_shard, self.collectives = shard, collectives

    def bind_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            layer.self_attn.kv_cache = kv_cache

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: Any) -> torch.Tensor:
        """Hidden states [T, hidden] before the final norm."""
        hidden = self.embed_tokens(input_ids)
        rotary = self.rotary_embedding(positions, hidden.dtype)
        local_rotary = (
            rotary_cos_sin(self.local_rope_table, positions, hidden.dtype)
            if self.local_rope_table is not None
            else None
        )
        sink_rotaries = self._sink_rotaries(positions, hidden.dtype)
        residual = None
        for layer in self.layers:
            layer_rotary = local_rotary if layer.local_rotary else rotary
            last_cache_position = layer.self_attn.layer_attention.last_cache_position
            sink_rotary = sink_rotaries.get((layer.local_rotary, last_cache_position))
            hidden, residual = layer(hidden, residual, layer_rotary, attn_metadata, sink_rotary)
        return hidden + residual

    def _sink_rotaries(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> dict[tuple[bool, int], tuple[torch.Tensor, torch.Tensor]]:
        """StreamingLLM: cos and sin at each token's position in a sinks-plus-window cache (its
        position, up to the cache's last), per rotary table and cache length the layers use."""
        rotaries = {}
        for layer in self.layers:
            last_cache_position = layer.self_attn.layer_attention.last_cache_position
            key = (layer.local_rotary, last_cache_position)
            if last_cache_position is None or key in rotaries:
                continue
            table = self.local_rope_table if layer.local_rotary else self.rope_table
            rotaries[key] = rotary_cos_sin(table, positions.clamp(max=last_cache_position), dtype)
        return rotaries

    @property
    def has_sliding_window(self) -> bool:
        """Whether some layer attends within a sliding window at the served lengths."""
        return any(layer.self_attn.layer_attention.sliding_window is not None for layer in self.layers)

    @property
    def kv_window(self) -> int | None:
        """The most keys back any layer's query sees, when every layer has a window (then a
        sequence's KV before it, sinks apart, is never read again); else None."""
        windows = [layer.self_attn.layer_attention.sliding_window for layer in self.layers]
        return None if None in windows else max(windows)

    @property
    def kv_sink_tokens(self) -> int:
        """StreamingLLM's sinks: the first KV every query keeps seeing."""
        return max(layer.self_attn.layer_attention.sink_tokens for layer in self.layers)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Embeddings [T, hidden] of the tokens (gathered over the ranks when sharded), times
        Gemma's multiplier in their dtype (as transformers rounds it)."""
        if self.collectives is None:
            embedded = F.embedding(input_ids, self.embed_weight)
        else:
            embedded = vocab_parallel_embedding(
                input_ids, self.embed_weight, self.tensor_shard.vocab_range, self.collectives
            )
        if self.arch.embedding_multiplier != 1.0:
            embedded = embedded * torch.tensor(self.arch.embedding_multiplier, dtype=embedded.dtype)
        return embedded

    def rotary_embedding(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary embedding's cos and sin at `positions`, in `dtype`."""
        return rotary_cos_sin(self.rope_table, positions, dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """float32 logits [R, vocab] for the R rows that sample; sharded, on rank 0 only (the
        other ranks send their vocabulary slices and get None)."""
        normed = self.kernels.rms_norm(hidden, self.norm_weight, self.arch.rms_norm_eps)
        logits = self.lm_head(normed).float()
        cap = self.arch.final_logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        if self.collectives is None:
            return logits
        return gather_vocab_logits(logits, self.tensor_shard, self.collectives)

    def prepare_projections(
        self,
        quantization: str | None,
        quantized_prefill: bool,
        pack_onednn: bool,
        batch_invariant: bool = False,
        triton_matmuls: bool = False,
        activation_maxima: dict[str, torch.Tensor] | None = None,
        int8_weights: dict[str, Int8Weight] | None = None,
    ) -> None:
        """Every projection and the LM head in its fastest form here (the embedding stays as
        loaded). The LM head is never quantized below int8: its logits pick the token, and a
        tied embedding is often stored at 8 bits (SmolLM2's GGUF: Q8_0 beside Q4_1 layers).
        `batch_invariant`: packed projections give a row the same bits at any row count; with
        `triton_matmuls` (CUDA) and float weights, every projection and the LM head run on the
        row-invariant Triton matmul instead of cuBLAS, which picks its kernel by the row count;
        in float32 on native CPU kernels, on the row-invariant native matmul instead of torch's,
        which does too. `activation_maxima` (w8a8): calibrated input maxima per projection
        (`firsttoken.worker.activation_stats`), which smooth each into its int8 form;
        `int8_weights` (w8a8): each projection's levels, rounded offline."""
        if quantization == "w8a8":
            self._prepare_w8a8(activation_maxima, int8_weights, pack_onednn, batch_invariant)
            return
        if batch_invariant and triton_matmuls and quantization is None:
            # Imported here: triton is needed on CUDA only.
            from firsttoken.ops.triton_matmul import RowInvariantLinear

            replace_linears(self.layers, RowInvariantLinear.from_linear)
            self.lm_head = RowInvariantLinear.from_linear(self.lm_head)
            return
        native_kernels = self.kernels.native
        native_takes = native_row_invariant_available(self.embed_weight.dtype, native_kernels)
        if batch_invariant and quantization is None and native_takes:
            replace_linears(self.layers, lambda linear: row_invariant_linear(linear, native_kernels))
            self.lm_head = row_invariant_linear(self.lm_head, native_kernels)
            return
        # A quantized engine's steps past its quantized kernels' rows (a batch of more than 8,
        # a prefill) take the float weights: on the row-invariant matmul where an unquantized
        # engine would run them, not torch's (a batch of twelve 64-token prompts and 32 new tokens
        # each: 12.2 s on torch's, 7.1 s on it, int4 on a 2-core AVX2).
        if quantization is None and native_takes:
            # float32 without invariance: torch's matmul, but for the step sizes this machine runs
            # faster on the native row matmul (measured at start).
            self.lm_head = convert_decode_batches(self.layers, self.lm_head, native_kernels)
            return
        row_invariant_float = batch_invariant and native_takes
        convert_linears(
            self.layers, quantization, quantized_prefill, pack_onednn, native_kernels, row_invariant_float
        )
        if quantization is None:
            self.lm_head = head_linear(self.lm_head, pack_onednn, native_kernels, row_invariant_float)
        else:
            self.lm_head = fastest_linear(
                self.lm_head, "int8", quantized_prefill, pack_onednn, native_kernels, row_invariant_float
            )
        for module in self.modules():
            if isinstance(module, PackedLinear):
                module.pad_single_rows = batch_invariant

    def _prepare_w8a8(
        self,
        activation_maxima: dict[str, torch.Tensor] | None,
        int8_weights: dict[str, Int8Weight] | None,
        pack_onednn: bool,
        batch_invariant: bool,
    ) -> None:
        """Every layer projection in W8A8 (a sharded one's slice inside its all-reduce; maxima
        are for a whole model); the head stays float (one row per sampled token, where integer
        compute gains nothing, and its logits pick the token). A W8A8 checkpoint's projections
        take its levels and scales; those it left float stay float. `int8_weights` (levels
        rounded offline, `firsttoken.worker.w8a8_weights`) replace rounding to nearest. A rotated
        model's down_proj (`firsttoken.models.rotation`) turns its inputs in its quantization pass."""
        native_kernels = self.kernels.native
        row_invariant_float = batch_invariant and native_row_invariant_available(
            self.embed_weight.dtype, native_kernels
        )
        from_checkpoint = any(
            isinstance(module, Linear) and module.checkpoint_int8 is not None
            for module in self.layers.modules()
        )

        def quantized(name: str, module: nn.Module, swiglu_output: bool) -> nn.Module:
            if isinstance(module, RowParallelLinear):
                module.linear = quantized(name, module.linear, swiglu_output)
                return module
            # A rotated model's down_proj: one W8A8Linear, its inputs turned in the quantization pass.
            hadamard_block = module.hadamard.block if isinstance(module, HadamardInputs) else 1
            linear = module.projection if isinstance(module, HadamardInputs) else module
            bias = linear.bias.data if linear.bias is not None else None
            stored = linear.checkpoint_int8 if int8_weights is None else int8_weights[name]
            if stored is not None:
                return W8A8Linear(
                    stored.levels, stored.scales, bias, native_kernels, hadamard_block=hadamard_block,
                    swiglu_output=swiglu_output,
                )
            if from_checkpoint:
                return fastest_linear(linear, None, False, pack_onednn, native_kernels, row_invariant_float)
            activation_max = activation_maxima[name] if activation_maxima is not None else None
            return W8A8Linear.from_float(
                linear.weight.data, bias, native_kernels, activation_max, hadamard_block, swiglu_output
            )

        for name, owner, attribute in layer_projections(self.layers):
            swiglu_output = attribute == "gate_up_proj" and owner.silu_gated
            setattr(owner, attribute, quantized(name, getattr(owner, attribute), swiglu_output))
        self.lm_head = head_linear(self.lm_head, pack_onednn, native_kernels, row_invariant_float)
        for module in self.modules():
            if isinstance(module, PackedLinear):
                module.pad_single_rows = batch_invariant

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors in, fusing q/k/v and gate/up on the way."""
        WeightLoader(self).load(weights)


def layer_attention_of(
    arch: ModelArch, layer_index: int, max_positions: int, streaming_window: int | None, sink_tokens: int
) -> LayerAttention:
    """How the layer attends at sequences up to `max_positions`: its own window (see
    `ModelArch.layer_window`) or StreamingLLM's, whichever is narrower, with the sinks of the
    latter; soft-capped scores where the model has them. A window past every sequence is none."""
    own_window = arch.layer_window(layer_index, max_positions)
    streaming = (
        streaming_window if streaming_window is not None and streaming_window < max_positions else None
    )
    windows = [window for window in (own_window, streaming) if window is not None]
    return LayerAttention(
        sliding_window=min(windows) if windows else None,
        logit_softcap=arch.attention_logit_softcap,
        sink_tokens=sink_tokens if streaming is not None else 0,
    )


def every_layer_is_plain(
    arch: ModelArch, max_positions: int, streaming_window: int | None, sink_tokens: int
) -> bool:
    """Whether every layer attends causally over all its earlier keys, with no window, soft-cap
    or sinks (what a backend needs to know before the model is built)."""
    return all(
        layer_attention_of(arch, index, max_positions, streaming_window, sink_tokens).is_plain
        for index in range(arch.num_layers)
    )


LAYER_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def layer_projections(layers: nn.ModuleList) -> Iterator[tuple[str, nn.Module, str]]:
    """(name, owning module, attribute) of every layer's four projections, named
    `layers.{i}.{attribute}`."""
    for index, layer in enumerate(layers):
        for attribute in LAYER_PROJECTIONS:
            owner = layer.self_attn if attribute in ("qkv_proj", "o_proj") else layer.mlp
            yield f"layers.{index}.{attribute}", owner, attribute


def _rows_of(linear: Linear, rows: torch.Tensor) -> Linear:
    """A Linear computing only `rows` of `linear`'s outputs (column-parallel slice)."""
    weight = linear.weight.data
    sliced = Linear(weight.shape[1], rows.numel(), linear.bias is not None, weight.dtype).to(weight.device)
    sliced.weight.data = weight[rows.to(weight.device)].contiguous()
    if linear.bias is not None:
        sliced.bias.data = linear.bias.data[rows.to(weight.device)].contiguous()
    if linear.checkpoint_int8 is not None:
        sliced.checkpoint_int8 = linear.checkpoint_int8.rows(rows)
    return sliced


def _columns_of(linear: Linear, start: int, end: int, keeps_bias: bool) -> Linear:
    """A Linear over input features [start, end) of `linear` (row-parallel slice). The ranks'
    products are summed: only the one that `keeps_bias` adds the bias."""
    weight = linear.weight.data
    with_bias = keeps_bias and linear.bias is not None
    sliced = Linear(end - start, weight.shape[0], with_bias, weight.dtype).to(weight.device)
    sliced.weight.data = weight[:, start:end].contiguous()
    if with_bias:
        sliced.bias.data = linear.bias.data.clone()
    if linear.checkpoint_int8 is not None:
        sliced.checkpoint_int8 = linear.checkpoint_int8.columns(start, end)
    return sliced


_FUSED_PARTS = {"qkv_proj.weight": 3, "qkv_proj.bias": 3, "gate_up_proj.weight": 2, "gate_up_proj.bias": 2}


def _part_of(
    full: torch.Tensor, rows: tuple[int, int] | None, name: str, tensor: torch.Tensor
) -> torch.Tensor:
    """The rows of `full` that checkpoint tensor `name` fills (all of it for an unfused one),
    checked against the tensor's shape."""
    destination = full if rows is None else full[rows[0] : rows[1]]
    if destination.shape != tensor.shape:
        raise ValueError(
            f"model: tensor {name} has shape {tuple(tensor.shape)}, expected {tuple(destination.shape)}"
        )
    return destination


def _parts_of(parameter_name: str) -> int:
    """How many checkpoint tensors fill the parameter (3 for a fused q|k|v, 2 for gate|up)."""
    return _FUSED_PARTS.get(".".join(parameter_name.split(".")[-2:]), 1)


class WeightLoader:
    """Maps Hugging Face names onto the fused parameters and checks every one was filled.

    A W8A8 checkpoint's projections arrive as int8 levels (`.weight`) and per-channel scales
    (`.weight_scale`): both are gathered per fused parameter, which then holds their dequantized
    form and keeps them (`Linear.checkpoint_int8`)."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        self.model = model
        arch = model.arch
        self.q_size, self.kv_size, self.intermediate = arch.q_size, arch.kv_size, arch.intermediate_size
        # Fused parameters are filled in parts: count the parts each one still needs.
        self.missing_parts = {name: _parts_of(name) for name, _ in model.named_parameters()}
        self.int8_levels: dict[str, torch.Tensor] = {}
        self.int8_scales: dict[str, torch.Tensor] = {}
        self.missing_int8_parts: dict[str, int] = {}
        self.missing_scale_parts: dict[str, int] = {}

    def load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in weights:
            self._load_one(name, tensor)
        missing = sorted(name for name, parts in self.missing_parts.items() if parts > 0)
        if missing:
            raise ValueError(f"model: checkpoint lacks weights for {missing[:5]}")
        self._dequantize_int8_weights()
        if self.model.arch.rotated_dims < self.model.arch.head_dim:
            self._reorder_partial_rotary_dims()

    def _reorder_partial_rotary_dims(self) -> None:
        """Each query and key head's dims in `partial_rotary_order`'s layout (its rows of
        qkv_proj, and the head norms' weights), so the full-head rotary kernels rotate only the
        first rotary_dim dims of the checkpoint's layout. Values keep theirs."""
        arch = self.model.arch
        order = partial_rotary_order(arch.head_dim, arch.rotated_dims)
        heads = arch.num_heads + arch.num_kv_heads
        query_key_rows = (torch.arange(heads)[:, None] * arch.head_dim + order).reshape(-1)
        value_rows = torch.arange(heads * arch.head_dim, arch.q_size + 2 * arch.kv_size)
        rows = torch.cat([query_key_rows, value_rows])
        for layer in self.model.layers:
            attention = layer.self_attn
            projection = attention.qkv_proj
            projection.weight.data = projection.weight.data[rows].contiguous()
            if projection.bias is not None:
                projection.bias.data = projection.bias.data[rows].contiguous()
            if projection.checkpoint_int8 is not None:
                projection.checkpoint_int8 = projection.checkpoint_int8.rows(rows)
            for norm_weight in (attention.q_norm_weight, attention.k_norm_weight):
                if norm_weight is not None:
                    norm_weight.data = norm_weight.data[order].contiguous()

    def _load_one(self, name: str, tensor: torch.Tensor) -> None:
        if name.endswith(".weight_zero_point"):
            if torch.any(tensor != 0):
                raise ValueError(f"model: {name} is not zero (only symmetric int8 weights are supported)")
            return
        is_scale = name.endswith(".weight_scale")
        target, rows = self._target(name.removesuffix("_scale") if is_scale else name)
        if target is None:
            if name.startswith("lm_head.") and self.model.arch.tie_word_embeddings:
                return
            if name.endswith("rotary_emb.inv_freq"):
                return
            raise ValueError(f"model: unexpected tensor {name} in checkpoint")
        parameter = self.model.get_parameter(target)
        if is_scale:
            scales = tensor.reshape(-1).float()
            self._stage_int8(name, target, rows, scales, self.int8_scales, parameter.shape[:1])
            self._count_part(self.missing_scale_parts, target, rows)
            return
        if tensor.dtype == torch.int8:
            self._stage_int8(name, target, rows, tensor, self.int8_levels, parameter.shape)
            self._count_part(self.missing_int8_parts, target, rows)
            self._count_part(self.missing_parts, target, rows)
            return
        offset = self.model.arch.norm_weight_offset
        if offset and target.endswith("norm_weight"):
            tensor = tensor.float() + offset  # Gemma's norms weigh by (1 + weight)
        _part_of(parameter.data, rows, name, tensor).copy_(tensor)
        self._count_part(self.missing_parts, target, rows)

    @staticmethod
    def _count_part(missing: dict[str, int], target: str, rows: tuple[int, int] | None) -> None:
        """One more part of `target` filled (a tensor for the whole of a fused one fills all)."""
        missing.setdefault(target, _parts_of(target))
        missing[target] = missing[target] - 1 if rows is not None else 0

    def _stage_int8(
        self,
        name: str,
        target: str,
        rows: tuple[int, int] | None,
        tensor: torch.Tensor,
        staged: dict[str, torch.Tensor],
        shape: torch.Size,
    ) -> None:
        """Copy a projection's int8 levels or scales into the fused parameter's staging tensor."""
        if not isinstance(self.model.get_submodule(target.removesuffix(".weight")), Linear):
            raise ValueError(f"model: {name} quantizes a tensor that is not a projection's weight")
        if target not in staged:
            staged[target] = torch.zeros(shape, dtype=tensor.dtype)
        _part_of(staged[target], rows, name, tensor).copy_(tensor)

    def _dequantize_int8_weights(self) -> None:
        """Each int8 projection's float weight from its levels and scales, which it keeps."""
        for target in sorted(set(self.int8_levels) | set(self.int8_scales)):
            if self.missing_int8_parts.get(target, _parts_of(target)) > 0:
                raise ValueError(f"model: {target} mixes int8 and float parts, or has scales without levels")
            if target not in self.int8_scales or self.missing_scale_parts[target] > 0:
                raise ValueError(f"model: checkpoint lacks weight_scale for parts of {target}")
            int8_weight = Int8Weight(self.int8_levels[target], self.int8_scales[target])
            self.model.get_parameter(target).data.copy_(int8_weight.dequantized())
            self.model.get_submodule(target.removesuffix(".weight")).checkpoint_int8 = int8_weight

    # Hugging Face's post_attention_layernorm is the norm before the MLP, except in Gemma's
    # sandwich, where it norms the attention's output and pre_feedforward_layernorm comes before
    # the MLP.
    _pre_norms = {"post_attention_layernorm.weight": ("post_attention_norm_weight", None)}
    _sandwich_norms = {
        "post_attention_layernorm.weight": ("attention_output_norm_weight", None),
        "pre_feedforward_layernorm.weight": ("post_attention_norm_weight", None),
        "post_feedforward_layernorm.weight": ("mlp_output_norm_weight", None),
    }

    def _target(self, name: str) -> tuple[str | None, tuple[int, int] | None]:
        q, kv, inter = self.q_size, self.kv_size, self.intermediate
        globals_ = {
            "model.embed_tokens.weight": "embed_weight",
            "model.norm.weight": "norm_weight",
            "lm_head.weight": None if self.model.arch.tie_word_embeddings else "lm_head.weight",
        }
        if name in globals_:
            return globals_[name], None
        parts = name.split(".")
        if len(parts) < 5 or parts[:2] != ["model", "layers"]:
            return None, None
        prefix = f"layers.{parts[2]}"
        local = ".".join(parts[3:])
        fused = {
            "self_attn.q_proj.weight": ("self_attn.qkv_proj.weight", (0, q)),
            "self_attn.k_proj.weight": ("self_attn.qkv_proj.weight", (q, q + kv)),
            "self_attn.v_proj.weight": ("self_attn.qkv_proj.weight", (q + kv, q + 2 * kv)),
            "self_attn.q_proj.bias": ("self_attn.qkv_proj.bias", (0, q)),
            "self_attn.k_proj.bias": ("self_attn.qkv_proj.bias", (q, q + kv)),
            "self_attn.v_proj.bias": ("self_attn.qkv_proj.bias", (q + kv, q + 2 * kv)),
            "self_attn.o_proj.weight": ("self_attn.o_proj.weight", None),
            "self_attn.o_proj.bias": ("self_attn.o_proj.bias", None),
            "mlp.gate_proj.weight": ("mlp.gate_up_proj.weight", (0, inter)),
            "mlp.up_proj.weight": ("mlp.gate_up_proj.weight", (inter, 2 * inter)),
            "mlp.down_proj.weight": ("mlp.down_proj.weight", None),
            "mlp.gate_proj.bias": ("mlp.gate_up_proj.bias", (0, inter)),
            "mlp.up_proj.bias": ("mlp.gate_up_proj.bias", (inter, 2 * inter)),
            "mlp.down_proj.bias": ("mlp.down_proj.bias", None),
            "input_layernorm.weight": ("input_norm_weight", None),
            **(self._sandwich_norms if self.model.arch.sandwich_norms else self._pre_norms),
            # Qwen3
            "self_attn.q_norm.weight": ("self_attn.q_norm_weight", None),
            "self_attn.k_norm.weight": ("self_attn.k_norm_weight", None),
            # Phi-3 checkpoints hold the fused projections, in the same q|k|v and gate|up order.
            "self_attn.qkv_proj.weight": ("self_attn.qkv_proj.weight", None),
            "mlp.gate_up_proj.weight": ("mlp.gate_up_proj.weight", None),
            "mlp.gate_up_proj.bias": ("mlp.gate_up_proj.bias", None),
        }
        if local not in fused:
            return None, None
        target, rows = fused[local]
        return f"{prefix}.{target}", rows
