"""Attention on AVX512-BF16 and AMX, and the KV write: causal prefill attention, flash-style, and
decode rows with its arithmetic (csrc/prefill_attention.c), on AMX tiles (x86-64 CPUs with
AMX-BF16) else on AVX512-BF16; paged decode attention in one exact softmax
(csrc/paged_decode_attention.c); the KV cache write (csrc/row_kernels.c). The portable flash
attention is `firsttoken.ops.native_flash_attention`'s."""

from __future__ import annotations

import torch

from firsttoken.ops import native_abi
from firsttoken.ops.native_library import NativeLibrary, check, dtype_code, heads_contiguous


def attention_output(kernel: str, query: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """Where an attention kernel writes its rows: `out` where given (contiguous, query's shape
    and dtype, on the CPU: a caller's slice of the step's output, so the rows are not copied
    there afterwards), else a new tensor."""
    if out is None:
        return query.new_empty(query.shape)
    fits = out.shape == query.shape and out.dtype == query.dtype and out.device.type == "cpu"
    if not (fits and out.is_contiguous()):
        raise ValueError(
            f"{kernel}: out must be a contiguous CPU {query.dtype} tensor of the queries' shape "
            f"{tuple(query.shape)}, got {out.dtype} {tuple(out.shape)} on {out.device.type}"
            f"{'' if out.is_contiguous() else ', not contiguous'}"
        )
    return out


def paged_decode_arguments(
    query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor
) -> dict[str, int | float]:
    """The parameters every paged decode attention kernel shares: query [rows, heads, head_dim]
    over kv_cache [2, blocks, block_size, kv_heads, head_dim] through block_table (contiguous
    long [rows, max_blocks]) and seq_lens (contiguous long [rows])."""
    rows, num_heads, head_dim = query.shape
    _, num_blocks, block_size, num_kv_heads, _ = kv_cache.shape
    return {
        "query": query.data_ptr(), "query_stride": query.stride(0), "kv_cache": kv_cache.data_ptr(),
        "num_slots": num_blocks * block_size, "block_table": block_table.data_ptr(),
        "max_blocks": block_table.shape[1], "seq_lens": seq_lens.data_ptr(), "block_size": block_size,
        "rows": rows, "num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim,
        "scale": head_dim**-0.5,
    }


class AttentionKernels:
    """The KV cache write (every build), and the bf16 prefill and paged decode attention of
    AVX512-BF16 builds."""

    def __init__(self, library: NativeLibrary) -> None:
        self._library = library
        self._kernels = library.kernels
        self.has_prefill_attention = "ft_prefill_attention" in self._kernels

    def write_kv(
        self, kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """key and value [rows, kv_heads, head_dim], heads contiguous (rows may be strided);
        kv_cache contiguous [2, blocks, block_size, kv_heads, head_dim]; slot_mapping contiguous int64."""
        rows, kv_heads, head_dim = key.shape
        num_slots = kv_cache.shape[1] * kv_cache.shape[2]
        status = self._kernels["ft_write_kv"](
            cache=kv_cache.data_ptr(), values_offset=kv_cache.numel() // 2, num_slots=num_slots,
            key=key.data_ptr(), key_row_stride=key.stride(0), value=value.data_ptr(),
            value_row_stride=value.stride(0), slots=slot_mapping.data_ptr(), rows=rows,
            row_elems=kv_heads * head_dim, dtype=dtype_code(key), num_threads=torch.get_num_threads(),
        )
        check(status, out_of_bounds=f"slot_mapping: a slot lies outside the cache's {num_slots} slots")

    def prefill_attention_supports(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
        """Whether `prefill_attention` takes these: bf16 on the CPU, heads contiguous, a head
        size of whole 32-dim tiles."""
        head_dim = query.shape[2]
        return (
            self.has_prefill_attention and query.dtype == key.dtype == value.dtype == torch.bfloat16
            and query.device.type == "cpu" and head_dim % native_abi.PREFILL_HEAD_DIM_MULTIPLE == 0
            and head_dim <= native_abi.PREFILL_MAX_HEAD_DIM
            and all(heads_contiguous(x) for x in (query, key, value))
        )

    def prefill_attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        num_threads: int,
        use_amx: bool | None = None,
        window: int = 0,
        softcap: float = 0.0,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Causal attention of query [n, heads, head_dim] over key and value [m, kv_heads,
        head_dim], m >= n, the queries being the last n of the m positions (new tokens after
        m - n of context); with `window` > 0 each over its last `window` keys (the keys before
        the first query's window never read); with `softcap` > 0 scaled scores s taken as
        softcap * tanh(s / softcap). Inputs must pass `prefill_attention_supports`.
        On AMX tiles where the CPU has them (`use_amx` None), else on AVX512-BF16. Written
        into `out` where given (see `attention_output`), which is returned."""
        use_amx = self._library.has_amx if use_amx is None else use_amx
        if use_amx and not self._library.has_amx:
            raise ValueError("prefill_attention: use_amx asked for on a CPU without AMX tiles")
        num_queries, num_heads, head_dim = query.shape
        num_keys, num_kv_heads = key.shape[0], key.shape[1]
        if (
            not 1 <= num_queries <= num_keys or value.shape[0] != num_keys or num_heads % num_kv_heads
            or window < 0 or softcap < 0
        ):
            raise ValueError(
                f"prefill_attention: {num_queries} queries of {num_heads} heads over {num_keys} keys and "
                f"{value.shape[0]} values of {num_kv_heads} heads, window {window}, softcap {softcap}"
            )
        out = attention_output("prefill_attention", query, out)
        check(
            self._kernels["ft_prefill_attention"](
                query=query.data_ptr(), query_row_stride=query.stride(0), key=key.data_ptr(),
                key_row_stride=key.stride(0), value=value.data_ptr(), value_row_stride=value.stride(0),
                num_queries=num_queries, num_keys=num_keys, num_heads=num_heads, num_kv_heads=num_kv_heads,
                head_dim=head_dim, scale=head_dim**-0.5, window=window, softcap=softcap, out=out.data_ptr(),
                num_threads=max(1, num_threads), use_amx=int(use_amx),
            )
        )
        return out

    def paged_decode_attention_supports(self, query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
        """Whether `paged_decode_attention` takes these: bf16 on the CPU, query heads
        contiguous, a contiguous cache, a head size of 32 to `native_abi.DECODE_MAX_HEAD_DIM`
        in whole 32-dim chunks."""
        head_dim = query.shape[2]
        return (
            self._library.has_decode_kernels and query.dtype == kv_cache.dtype == torch.bfloat16
            and query.device.type == "cpu" and kv_cache.is_contiguous() and heads_contiguous(query)
            and head_dim % native_abi.DECODE_HEAD_DIM_MULTIPLE == 0
            and head_dim <= native_abi.DECODE_MAX_HEAD_DIM
        )

    def paged_decode_attention(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        as_prefill: bool = False,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        """Attention of one new query per sequence, query [rows, heads, head_dim], over the
        first seq_lens[r] keys of sequence r, read in place through block_table (long [rows,
        max_blocks]) from kv_cache [2, blocks, block_size, kv_heads, head_dim]. Inputs must pass
        `paged_decode_attention_supports`; seq_lens long [rows]. `as_prefill`: with the prefill
        kernel's arithmetic (its 64-key tiles and online softmax; block_size a multiple of
        16), so a row gets the bits a prefill of the same tokens gives its position; else one
        exact softmax over all keys, a little faster. With `as_prefill` only: `window` > 0,
        each row over its last `window` keys, the blocks before them never read; `softcap` > 0,
        scaled scores s taken as softcap * tanh(s / softcap)."""
        rows, num_heads, _ = query.shape
        _, _, block_size, num_kv_heads, _ = kv_cache.shape
        if (
            block_table.shape[0] != rows or seq_lens.shape != (rows,) or num_heads % num_kv_heads
            or block_table.dtype != torch.long or seq_lens.dtype != torch.long
            or (as_prefill and block_size % native_abi.DECODE_AS_PREFILL_BLOCK_MULTIPLE)
            or window < 0 or softcap < 0 or ((window or softcap) and not as_prefill)
        ):
            raise ValueError(
                f"paged_decode_attention: {rows} queries of {num_heads} heads, block table "
                f"{tuple(block_table.shape)} {block_table.dtype}, seq_lens {tuple(seq_lens.shape)} "
                f"{seq_lens.dtype}, "
                f"{num_kv_heads} KV heads, blocks of {block_size}, window {window}, softcap {softcap} "
                f"(as_prefill {as_prefill})"
            )
        block_table = block_table.contiguous()
        seq_lens = seq_lens.contiguous()
        out = query.new_empty(query.shape)
        arguments = {
            **paged_decode_arguments(query, kv_cache, block_table, seq_lens), "out": out.data_ptr(),
            "num_threads": torch.get_num_threads(),
        }
        if as_prefill:
            status = self._kernels["ft_decode_attention_as_prefill"](
                **arguments, window=window, softcap=softcap, use_amx=int(self._library.has_amx)
            )
        else:
            status = self._kernels["ft_paged_decode_attention"](**arguments)
        check(
            status,
            out_of_bounds="paged_decode_attention: a block id or sequence length lies outside the KV cache",
        )
        return out
