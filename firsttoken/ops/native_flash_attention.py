"""Flash attention in float32 arithmetic for every CPU class, on float32 or bf16 tensors
(csrc/attention.c): prefills, chunks reading their cached context in place through block ids,
and decode rows with a prefill's bits."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from firsttoken.ops import native_abi
from firsttoken.ops.native_attention import attention_output, paged_decode_arguments
from firsttoken.ops.native_library import NativeLibrary, check, dtype_code, heads_contiguous, supports


@dataclass
class _Variant:
    """The flash kernels' window, softcap and sink arguments, holding the sink query (laid out as
    the query: the kernels step through both by its row stride) while the kernel runs."""

    window: int
    softcap: float
    sink_tokens: int
    sink_query: torch.Tensor | None

    @classmethod
    def of(
        cls,
        query: torch.Tensor,
        window: int,
        softcap: float,
        sink_tokens: int,
        sink_query: torch.Tensor | None,
    ) -> _Variant:
        if sink_query is not None:
            if sink_query.shape != query.shape or sink_query.dtype != query.dtype:
                raise ValueError(
                    f"sink_query: {tuple(sink_query.shape)} {sink_query.dtype}, query {tuple(query.shape)}"
                )
            if sink_query.stride() != query.stride():
                laid_out = torch.empty_strided(query.shape, query.stride(), dtype=query.dtype)
                sink_query = laid_out.copy_(sink_query)
        return cls(window, softcap, sink_tokens, sink_query)

    def arguments(self) -> dict[str, int | float | None]:
        return {
            "window": self.window, "softcap": self.softcap, "sink_tokens": self.sink_tokens,
            "sink_query": self.sink_query.data_ptr() if self.sink_query is not None else None,
        }


class FlashAttentionKernels:
    """The portable flash attention: causal prefill, a chunk over the paged cache, paged decode."""

    def __init__(self, library: NativeLibrary) -> None:
        self._kernels = library.kernels
        # The kernels take head sizes in whole vectors of this build.
        self.flash_head_dim_multiple: int = self._kernels["ft_flash_attention_head_dim_multiple"]()

    def flash_attention_supports(self, query: torch.Tensor, key_values: torch.Tensor) -> bool:
        """Whether the portable flash attention takes query [n, heads, head_dim] over K/V of
        `key_values`' dtype (a K tensor or the paged cache): the same dtype, float32 or bf16, on
        the CPU, query heads contiguous, a head size of whole vectors up to
        `native_abi.ATTENTION_MAX_HEAD_DIM`."""
        head_dim = query.shape[2]
        return (
            supports(query) and query.dtype == key_values.dtype and key_values.device.type == "cpu"
            and heads_contiguous(query) and head_dim % self.flash_head_dim_multiple == 0
            and head_dim <= native_abi.ATTENTION_MAX_HEAD_DIM
        )

    def flash_attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        num_threads: int,
        window: int = 0,
        softcap: float = 0.0,
        sink_tokens: int = 0,
        sink_query: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Causal attention of query [n, heads, head_dim] over key and value [m, kv_heads,
        head_dim] (heads contiguous, rows strided), m >= n, the queries being the last n of the m
        positions, each over its last `window` keys only when window > 0, scaled scores s taken as
        softcap * tanh(s / softcap) when softcap > 0; float32 arithmetic, the inputs' dtype out.
        With sink_tokens > 0 (and a window), keys 0..sink_tokens-1 too, scored with sink_query
        (shaped as query) once a row's window has left them (StreamingLLM). Inputs must pass
        `flash_attention_supports` (key and value too). Written into `out` where given (see
        `attention_output`), which is returned."""
        num_keys, num_kv_heads = key.shape[0], key.shape[1]
        if value.shape != key.shape or not (heads_contiguous(key) and heads_contiguous(value)):
            raise ValueError(f"flash_attention: keys {tuple(key.shape)} and values {tuple(value.shape)}")
        key_values = {
            "key": key.data_ptr(), "key_stride": key.stride(0), "value": value.data_ptr(),
            "value_stride": value.stride(0), "block_ids": None, "num_block_ids": 0, "block_size": 1,
            "num_slots": num_keys,
        }
        return self._flash_attention(
            "flash_attention", query, key_values, num_keys, num_kv_heads, num_threads,
            _Variant.of(query, window, softcap, sink_tokens, sink_query), out,
        )

    def flash_attention_paged(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        block_ids: torch.Tensor,
        num_keys: int,
        num_threads: int,
        window: int = 0,
        softcap: float = 0.0,
        sink_tokens: int = 0,
        sink_query: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`flash_attention` over the first num_keys keys of one sequence, read in place from
        kv_cache [2, blocks, block_size, kv_heads, head_dim] (contiguous) through its block ids
        (long [>= ceil(num_keys / block_size)]): a chunk on cached context with no gather, the
        bits `flash_attention` gives the same keys. Blocks wholly before every query's window
        are never read. Written into `out` where given, as `flash_attention`."""
        _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
        if not kv_cache.is_contiguous() or block_ids.dtype != torch.long or block_ids.dim() != 1:
            raise ValueError(f"flash_attention_paged: block ids {tuple(block_ids.shape)} {block_ids.dtype}")
        block_ids = block_ids.contiguous()
        kv_width = num_kv_heads * head_dim
        key_values = {
            "key": kv_cache[0].data_ptr(), "key_stride": kv_width, "value": kv_cache[1].data_ptr(),
            "value_stride": kv_width, "block_ids": block_ids.data_ptr(), "num_block_ids": block_ids.shape[0],
            "block_size": block_size, "num_slots": num_blocks * block_size,
        }
        return self._flash_attention(
            "flash_attention_paged", query, key_values, num_keys, num_kv_heads, num_threads,
            _Variant.of(query, window, softcap, sink_tokens, sink_query), out,
        )

    def _flash_attention(
        self,
        name: str,
        query: torch.Tensor,
        key_values: dict[str, int | None],
        num_keys: int,
        num_kv_heads: int,
        num_threads: int,
        variant: _Variant,
        out: torch.Tensor | None,
    ) -> torch.Tensor:
        """Runs ft_flash_attention over the K/V rows `key_values` locates (its parameters from
        `key` to `num_slots`), with `variant`'s window, softcap and sinks, into `out` (None: a
        new tensor)."""
        num_queries, num_heads, head_dim = query.shape
        out = attention_output(name, query, out)
        status = self._kernels["ft_flash_attention"](
            query=query.data_ptr(), query_stride=query.stride(0), **key_values, num_queries=num_queries,
            num_keys=num_keys, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
            scale=head_dim**-0.5, **variant.arguments(), out=out.data_ptr(), dtype=dtype_code(query),
            num_threads=max(1, num_threads),
        )
        self._check_flash(status, name, query, num_keys, num_kv_heads)
        return out

    def flash_decode_attention(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        window: int = 0,
        softcap: float = 0.0,
        sink_tokens: int = 0,
        sink_query: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One new query per sequence, query [rows, heads, head_dim], over the first seq_lens[r]
        keys of sequence r (the last `window` of them when window > 0; softcap and sinks as
        `flash_attention`'s), read in place through
        block_table (long [rows, max_blocks]) from kv_cache [2, blocks, block_size, kv_heads,
        head_dim] (contiguous): for each row the bits `flash_attention` gives the last position of
        a prefill of those keys, whatever the other rows. Inputs must pass
        `flash_attention_supports`; seq_lens long [rows]."""
        rows = query.shape[0]
        if (
            block_table.shape[0] != rows or seq_lens.shape != (rows,) or not kv_cache.is_contiguous()
            or block_table.dtype != torch.long or seq_lens.dtype != torch.long
        ):
            raise ValueError(
                f"flash_decode_attention: {rows} queries, block table {tuple(block_table.shape)} "
                f"{block_table.dtype}, seq_lens {tuple(seq_lens.shape)} {seq_lens.dtype}"
            )
        block_table = block_table.contiguous()
        seq_lens = seq_lens.contiguous()
        out = query.new_empty(query.shape)
        variant = _Variant.of(query, window, softcap, sink_tokens, sink_query)
        status = self._kernels["ft_flash_decode_attention"](
            **paged_decode_arguments(query, kv_cache, block_table, seq_lens), **variant.arguments(),
            out=out.data_ptr(), dtype=dtype_code(query), num_threads=torch.get_num_threads(),
        )
        self._check_flash(status, "flash_decode_attention", query, int(seq_lens.max()), kv_cache.shape[3])
        return out

    def _check_flash(
        self, status: int, name: str, query: torch.Tensor, num_keys: int, num_kv_heads: int
    ) -> None:
        if status == native_abi.Status.BAD_SHAPE:
            num_queries, num_heads, head_dim = query.shape
            raise ValueError(
                f"{name}: {num_queries} queries of {num_heads} heads over {num_keys} keys of "
                f"{num_kv_heads} heads (needs 1 <= queries <= keys and heads a multiple of KV heads), "
                f"head_dim {head_dim} (needs a "
                f"multiple of {self.flash_head_dim_multiple} up to {native_abi.ATTENTION_MAX_HEAD_DIM})"
            )
        check(
            status,
            out_of_bounds=(
                f"{name}: a block id or sequence length lies outside the KV cache or the block table"
            ),
        )
