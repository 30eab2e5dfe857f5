"""The compiled CPU kernels against their plain torch references, and their routing."""

from __future__ import annotations

import logging

import pytest
import torch

from firsttoken.attention.reference import write_kv_reference
from firsttoken.ops import native
from firsttoken.ops.kernels import FUSED_MIN_TOKENS, Kernels
from firsttoken.ops.rotary import apply_rotary_reference, cos_sin_table, inverse_frequencies, rotary_cos_sin

# The kernels round where the references round; what is left is float32 summation order
# (a norm's sum of squares, SwiGLU's exp), which can move a bf16 result by one step.
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=1.6e-2)}
ROW_COUNTS = [1, 3, 130, 700]  # 700: split over threads


@pytest.fixture(scope="module")
def kernels(native_kernels) -> native.NativeKernels:
    if native_kernels is None:
        pytest.skip("no working C compiler on this machine")
    return native_kernels


@pytest.fixture(scope="module")
def attention_kernels(kernels) -> native.NativeKernels:
    if not kernels.attention.has_prefill_attention:
        pytest.skip("no native prefill attention on this CPU (needs AVX512-BF16)")
    return kernels


@pytest.fixture(params=["avx512-bf16", "amx"])
def use_amx(request, attention_kernels) -> bool:
    """Each of the kernel's two forms this CPU can run."""
    if request.param == "amx" and not attention_kernels.has_amx:
        pytest.skip("no AMX tiles on this CPU")
    return request.param == "amx"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", ROW_COUNTS)
# 64: each half in whole vectors (rotated in registers); 48: on AVX2's 8-float vectors only;
# 36: on neither (the scratch path).
@pytest.mark.parametrize("head_dim", [64, 48, 36])
def test_rotary_rotates_strided_heads_in_place(kernels, dtype, rows, head_dim):
    table = cos_sin_table(inverse_frequencies(head_dim, 10000.0, None, None), 4096)
    cos, sin = rotary_cos_sin(table, torch.randint(0, 4096, (rows,)), dtype)
    qkv = torch.randn(rows, 15 * head_dim).to(dtype)
    value_before = qkv[:, 12 * head_dim :].clone()
    query_key = qkv[:, : 12 * head_dim].view(rows, 12, head_dim)  # rows strided as in the model
    expected = apply_rotary_reference(query_key, cos, sin)
    rotated = kernels.rows.apply_rotary_(query_key, cos, sin)
    assert rotated.data_ptr() == qkv.data_ptr()
    torch.testing.assert_close(rotated, expected, **TOLERANCE[dtype])
    torch.testing.assert_close(qkv[:, 12 * head_dim :], value_before, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [5, 700])  # 700: split over threads
def test_write_kv_matches_index_copy(kernels, dtype, rows):
    num_blocks, block_size, kv_heads, head_dim = 200, 4, 3, 64
    qkv = torch.randn(rows, 15 * 64).to(dtype)
    key = qkv[:, 9 * 64 : 12 * 64].view(rows, kv_heads, head_dim)
    value = qkv[:, 12 * 64 :].contiguous().view(rows, kv_heads, head_dim)  # a different row stride
    slots = torch.randperm(num_blocks * block_size, generator=torch.Generator().manual_seed(rows))[:rows]
    expected = torch.randn(2, num_blocks, block_size, kv_heads, head_dim).to(dtype)
    ours = expected.clone()
    write_kv_reference(expected, key, value, slots)
    kernels.attention.write_kv(ours, key, value, slots)
    torch.testing.assert_close(ours, expected, atol=0, rtol=0)


def test_write_kv_rejects_a_slot_outside_the_cache_and_writes_nothing(kernels):
    cache = torch.zeros(2, 2, 4, 1, 64)
    key = value = torch.ones(2, 1, 64)
    with pytest.raises(IndexError, match="slot_mapping"):
        kernels.attention.write_kv(cache, key, value, torch.tensor([1, 8]))
    assert not cache.any()


def test_every_step_size_takes_the_native_kernels_and_plain_ops_do_not(kernels):
    routed = Kernels(fused=True, native_kernels=kernels)
    table = cos_sin_table(inverse_frequencies(64, 10000.0, None, None), 4096)
    for rows in [1, FUSED_MIN_TOKENS - 1, FUSED_MIN_TOKENS + 3]:
        x = torch.randn(rows, 12, 64).to(torch.bfloat16)
        cos, sin = rotary_cos_sin(table, torch.arange(rows), torch.bfloat16)
        assert routed.apply_rotary(x, cos, sin).data_ptr() == x.data_ptr()  # rotated in place
    half_precision = torch.randn(2, 12, 64).to(torch.float16)
    cos, sin = rotary_cos_sin(table, torch.arange(2), torch.float16)
    assert routed.apply_rotary(half_precision, cos, sin).data_ptr() != half_precision.data_ptr()
    plain = Kernels(fused=False, native_kernels=kernels)
    x = torch.randn(2, 12, 64)
    cos, sin = rotary_cos_sin(table, torch.arange(2), torch.float32)
    assert plain.apply_rotary(x, cos, sin).data_ptr() != x.data_ptr()


def _load_with_compiler(compiler: str, cache_dir: str, monkeypatch, caplog) -> str:
    """What a fresh kernel load with `compiler` as CC logs (the load must fall back to torch)."""
    monkeypatch.setenv("CC", compiler)
    native.load_native_kernels.cache_clear()
    try:
        with caplog.at_level(logging.WARNING):
            assert native.load_native_kernels(cache_dir) is None
    finally:
        native.load_native_kernels.cache_clear()
    return caplog.text


def test_a_missing_compiler_leaves_the_torch_ops(tmp_path, monkeypatch, caplog):
    log = _load_with_compiler(
        str(tmp_path / "no-such-compiler"), str(tmp_path / "cache"), monkeypatch, caplog
    )
    assert "native CPU kernels unavailable" in log


def test_a_failed_build_leaves_the_torch_ops_and_shows_the_compiler_errors(tmp_path, monkeypatch, caplog):
    failing_compiler = tmp_path / "failing-cc"
    failing_compiler.write_text(
        "#!/bin/sh\necho 'decode_step.c:1: error: a static assertion failed' >&2\nexit 1\n"
    )
    failing_compiler.chmod(0o755)
    log = _load_with_compiler(str(failing_compiler), str(tmp_path / "cache"), monkeypatch, caplog)
    assert "a static assertion failed" in log


def _causal_attention_reference(query, key, value, window=0, softcap=0.0):
    """float32 softmax(Q K^T / sqrt(d)) V, query i seeing keys up to i + (keys - queries) (its
    last `window` of them, window > 0; scaled scores soft-capped, softcap > 0)."""
    num_queries, num_heads, head_dim = query.shape
    num_keys, num_kv_heads = key.shape[0], key.shape[1]
    group = num_heads // num_kv_heads
    scores = (
        torch.einsum("qhd,khd->hqk", query.float(), key.float().repeat_interleave(group, 1)) / head_dim**0.5
    )
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    offsets = torch.arange(num_queries)[:, None] + (num_keys - num_queries) - torch.arange(num_keys)[None, :]
    allowed = (offsets >= 0) & ((offsets < window) if window else True)
    weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    return torch.einsum("hqk,khd->qhd", weights, value.float().repeat_interleave(group, 1))


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (4, 4, 32), (8, 2, 128)])
@pytest.mark.parametrize(
    "num_queries,num_keys",
    [(1, 1), (5, 5), (33, 33), (64, 64), (65, 129), (100, 100), (17, 300), (700, 700)],
)
def test_prefill_attention_matches_plain_math(
    attention_kernels, use_amx, num_heads, num_kv_heads, head_dim, num_queries, num_keys
):
    generator = torch.Generator().manual_seed(num_queries * 1000 + num_keys)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(num_keys, width, generator=generator).to(torch.bfloat16)  # rows strided as in the model
    query = qkv[-num_queries:, : num_heads * head_dim].view(num_queries, num_heads, head_dim)
    key = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(
        num_keys, num_kv_heads, head_dim
    )
    value = qkv[:, (num_heads + num_kv_heads) * head_dim :].view(num_keys, num_kv_heads, head_dim)
    assert attention_kernels.attention.prefill_attention_supports(query, key, value)
    output = attention_kernels.attention.prefill_attention(query, key, value, num_threads=2, use_amx=use_amx)
    expected = _causal_attention_reference(query, key, value)
    # bf16 inputs, probabilities rounded to bf16 before P V (as torch's flash kernel does).
    torch.testing.assert_close(output.float(), expected, atol=2e-2, rtol=2e-2)


def _bf16_qkv(num_queries, num_keys, num_heads=9, num_kv_heads=3, head_dim=64, seed=0):
    """Query [n, heads, D] and key, value [m, kv_heads, D] as strided views of one bf16 qkv."""
    generator = torch.Generator().manual_seed(seed)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(num_keys, width, generator=generator).to(torch.bfloat16)
    query = qkv[-num_queries:, : num_heads * head_dim].view(num_queries, num_heads, head_dim)
    key = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(
        num_keys, num_kv_heads, head_dim
    )
    value = qkv[:, (num_heads + num_kv_heads) * head_dim :].view(num_keys, num_kv_heads, head_dim)
    return query, key, value


# Scores of random unit-variance rows are ~N(0, 1): caps of 1 and 3 bend them visibly.
@pytest.mark.parametrize("window,softcap", [(1, 0.0), (16, 0.0), (64, 0.0), (100, 0.0), (0, 1.0), (16, 3.0)])
@pytest.mark.parametrize("num_queries,num_keys", [(100, 100), (17, 300), (300, 300), (65, 129)])
def test_windowed_and_soft_capped_prefill_attention_matches_plain_math(
    attention_kernels, use_amx, window, softcap, num_queries, num_keys
):
    query, key, value = _bf16_qkv(num_queries, num_keys, seed=window)
    output = attention_kernels.attention.prefill_attention(query, key, value, 2, use_amx, window, softcap)
    expected = _causal_attention_reference(query, key, value, window, softcap)
    torch.testing.assert_close(output.float(), expected, atol=2e-2, rtol=2e-2)
    if softcap:
        uncapped = _causal_attention_reference(query, key, value, window)
        assert not torch.allclose(expected, uncapped, atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("window,softcap", [(16, 0.0), (70, 0.0), (0, 1.0), (70, 3.0)])
def test_windowed_rows_keep_their_bits_in_any_chunk_and_as_decodes(
    attention_kernels, use_amx, window, softcap
):
    """Rows of one 300-token sequence: prefilled whole, in chunks cut off the 32-query and
    64-key tiles, and as decode rows through a paged cache whose blocks before each row's
    window hold NaN (back in the pool, they may hold anything): the same bits each way."""
    num_keys, block_size = 300, 16
    query, key, value = _bf16_qkv(num_keys, num_keys, seed=window)
    whole = attention_kernels.attention.prefill_attention(query, key, value, 2, use_amx, window, softcap)
    for start, end in ((0, 45), (45, 46), (46, 200), (200, 300)):
        rows = slice(start, end)
        chunk = attention_kernels.attention.prefill_attention(
            query[rows], key[:end], value[:end], 2, use_amx, window, softcap
        )
        assert torch.equal(chunk, whole[start:end]), (start, end)
    if use_amx != attention_kernels.has_amx:
        return  # decode rows take the CPU's own form (AMX where it has it), as the engine's prefills do
    positions = [0, 15, 16, 63, 64, 65, 130, 199, 299]
    num_blocks = num_keys // block_size + 1
    kv_cache = torch.zeros(2, num_blocks, block_size, 3, 64, dtype=torch.bfloat16)
    kv_cache[0].view(-1, 3, 64)[:num_keys] = key
    kv_cache[1].view(-1, 3, 64)[:num_keys] = value
    for position in positions:
        poisoned = kv_cache.clone()
        first_seen = max(0, position - window + 1) if window else 0
        poisoned.view(2, -1, 3, 64)[:, :first_seen] = float("nan")
        decoded = attention_kernels.attention.paged_decode_attention(
            query[position : position + 1],
            poisoned,
            torch.arange(num_blocks)[None, :],
            torch.tensor([position + 1]),
            as_prefill=True,
            window=window,
            softcap=softcap,
        )
        assert torch.equal(decoded[0], whole[position]), position


def test_windowed_prefill_never_reads_keys_before_its_first_querys_window(attention_kernels, use_amx):
    query, key, value = _bf16_qkv(40, 300, seed=3)
    clean = attention_kernels.attention.prefill_attention(query, key, value, 2, use_amx, window=32)
    first_seen = 300 - 40 - 32 + 1
    key, value = key.clone(), value.clone()
    key[:first_seen] = float("nan")
    value[:first_seen] = float("nan")
    unseen = attention_kernels.attention.prefill_attention(query, key, value, 2, use_amx, window=32)
    assert torch.equal(unseen, clean)


def test_prefill_attention_writes_into_a_given_slice_the_bits_it_returns(attention_kernels, use_amx):
    query, key, value = _bf16_qkv(70, 70, seed=4)
    alone = attention_kernels.attention.prefill_attention(query, key, value, 2, use_amx)
    step_output = torch.full((75, 9, 64), float("nan"), dtype=torch.bfloat16)
    rows = step_output[3:73]
    returned = attention_kernels.attention.prefill_attention(query, key, value, 2, use_amx, out=rows)
    assert returned is rows
    assert torch.equal(step_output[3:73], alone)
    assert step_output[:3].isnan().all() and step_output[73:].isnan().all()  # nothing outside the slice


@pytest.mark.parametrize(
    "out,complaint",
    [
        (torch.empty(70, 9, 32, dtype=torch.bfloat16), r"\(70, 9, 64\), got torch.bfloat16 \(70, 9, 32\)"),
        (torch.empty(70, 9, 64), "got torch.float32"),
        (torch.empty(70, 9, 128, dtype=torch.bfloat16)[:, :, :64], "not contiguous"),
    ],
)
def test_prefill_attention_names_an_out_it_cannot_write(attention_kernels, out, complaint):
    query, key, value = _bf16_qkv(70, 70, seed=4)
    with pytest.raises(ValueError, match=f"prefill_attention: out must be .*{complaint}"):
        attention_kernels.attention.prefill_attention(query, key, value, 1, out=out)


def test_prefill_attention_declines_what_it_cannot_take_and_names_bad_shapes(attention_kernels):
    query = torch.randn(4, 4, 16).to(torch.bfloat16)
    assert not attention_kernels.attention.prefill_attention_supports(query, query, query)  # head_dim 16
    assert not attention_kernels.attention.prefill_attention_supports(
        *(torch.randn(4, 4, 64) for _ in range(3))
    )  # float32
    query, key = torch.randn(8, 4, 64).to(torch.bfloat16), torch.randn(4, 4, 64).to(torch.bfloat16)
    with pytest.raises(ValueError, match="8 queries"):
        attention_kernels.attention.prefill_attention(query, key, key, num_threads=1)
    if not attention_kernels.has_amx:
        with pytest.raises(ValueError, match="without AMX"):
            attention_kernels.attention.prefill_attention(key, key, key, num_threads=1, use_amx=True)
