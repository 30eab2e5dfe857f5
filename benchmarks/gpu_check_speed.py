"""The device check's timings: the matmul rate, TTFT against the compute floor and against a
transformers forward, TTFT with steps replayed from CUDA graphs and run eagerly, decode tokens/s,
and the Triton elementwise ops against their eager references."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch

from gpu_check_models import random_prompt, synchronize, timed_generate
from gpu_check_plan import Plan, Shape

from firsttoken import LLM


# TTFT targets of the device check: a bound in seconds, or a multiple of the compute floor.
TTFT_TARGETS: dict[tuple[str, int], tuple[str, float]] = {
    ("llama2-7b", 128): ("seconds", 0.005),
    ("llama2-7b", 512): ("floor", 1.3),
    ("llama2-7b", 2048): ("floor", 1.15),
    ("llama2-7b", 8192): ("floor", 1.15),
    ("smollm2-135m", 128): ("seconds", 0.003),
    ("smollm2-135m", 512): ("seconds", 0.003),
}
# At these prompt lengths and below, each row must also beat the transformers forward by this much.
SPEEDUP_OVER_TRANSFORMERS = 1.5
SPEEDUP_MAX_TOKENS = 2048


def matmul_tflops(size: int, dtype: torch.dtype, device: torch.device, repeats: int = 10) -> float:
    """Median rate of a [size, size] x [size, size] matmul, in TFLOP/s."""
    a = torch.randn(size, size, dtype=dtype, device=device)
    b = torch.randn(size, size, dtype=dtype, device=device)
    for _ in range(3):
        a @ b
    timings = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        a @ b
        synchronize(device)
        timings.append(time.perf_counter() - start)
    return 2 * size**3 / statistics.median(timings) / 1e12


def ttft_lengths(shape: Shape, plan: Plan) -> list[int]:
    return [length for length in plan.ttft_lengths if length < shape.max_position_embeddings]


@torch.inference_mode()
def timed_reference_prefill(hf_model: Any, prompt: list[int], device: torch.device) -> float:
    """Wall time of transformers' forward over `prompt` to its first greedy token."""
    input_ids = torch.tensor([prompt], device=device)
    synchronize(device)
    start = time.perf_counter()
    int(hf_model(input_ids, logits_to_keep=1).logits[0, -1].argmax())
    return time.perf_counter() - start


def ttft_target(shape: Shape, num_tokens: int, floor_s: float) -> tuple[float | None, str]:
    """(the bound in seconds, how it reads) of a TTFT row; None where the shape has no target."""
    kind, value = TTFT_TARGETS.get((shape.name, num_tokens), ("none", 0.0))
    if kind == "seconds":
        return value, f"<= {value * 1e3:g} ms"
    if kind == "floor":
        return value * floor_s, f"<= {value:g}x floor"
    return None, "-"


def measure_ttft(
    llm: LLM, hf_model: Any, shape: Shape, plan: Plan, tflops: float, device: torch.device, seed: int
) -> list[dict]:
    rows = []
    for length in ttft_lengths(shape, plan):
        ours, reference = [], []
        for run in range(4):
            prompt = random_prompt(length, f"ttft-{seed}-{length}-{run}", shape.vocab_size)
            ours.append(timed_generate(llm, [prompt], 1))
            reference.append(timed_reference_prefill(hf_model, prompt, device))
        ttft, reference_ttft = statistics.median(ours[1:]), statistics.median(reference[1:])  # run 0 warms up
        floor = shape.forward_flops(length) / (tflops * 1e12)
        bound, target = ttft_target(shape, length, floor)
        speedup = reference_ttft / ttft
        meets = None  # shapes other than the device check's have no targets
        if any(name == shape.name for name, _ in TTFT_TARGETS):
            meets = (bound is None or ttft <= bound) and (
                length > SPEEDUP_MAX_TOKENS or speedup >= SPEEDUP_OVER_TRANSFORMERS
            )
        rows.append(
            {
                "prompt_tokens": length,
                "ttft_s": ttft,
                "floor_s": floor,
                "ratio": ttft / floor,
                "transformers_s": reference_ttft,
                "speedup_over_transformers": speedup,
                "target": target,
                "meets_targets": meets,
            }
        )
    return rows


def compare_graphs(graphed: LLM, eager: LLM, shape: Shape, plan: Plan, seed: int) -> list[dict]:
    """TTFT of prompts replayed from captured graphs against the same prompts run eagerly, in turns."""
    rows = []
    for length in ttft_lengths(shape, plan):
        graph_times, eager_times = [], []
        for run in range(4):
            prompt = random_prompt(length, f"graphs-{seed}-{length}-{run}", shape.vocab_size)
            graph_times.append(timed_generate(graphed, [prompt], 1))
            eager_times.append(timed_generate(eager, [prompt], 1))
        graph_ttft, eager_ttft = statistics.median(graph_times[1:]), statistics.median(eager_times[1:])
        rows.append(
            {
                "prompt_tokens": length,
                "graphs_s": graph_ttft,
                "eager_s": eager_ttft,
                "speedup": eager_ttft / graph_ttft,
            }
        )
    return rows


def measure_decode(llm: LLM, shape: Shape, plan: Plan, seed: int) -> list[dict]:
    rows = []
    for batch in plan.decode_batches:

        def prompts(run: int) -> list[list[int]]:
            keys = [f"decode-{seed}-{batch}-{run}-{i}" for i in range(batch)]
            return [random_prompt(plan.decode_prompt_tokens, key, shape.vocab_size) for key in keys]

        timed_generate(llm, prompts(0), 1 + plan.decode_new_tokens)  # warm-up
        prefill_only = statistics.median(timed_generate(llm, prompts(run), 1) for run in (1, 2, 3))
        with_decode = statistics.median(
            timed_generate(llm, prompts(run), 1 + plan.decode_new_tokens) for run in (4, 5, 6)
        )
        decode_seconds = max(with_decode - prefill_only, 1e-9)
        rows.append({"batch": batch, "tokens_per_s": batch * plan.decode_new_tokens / decode_seconds})
    return rows


def median_call_seconds(call: Callable[[], Any], device: torch.device, repeats: int = 50) -> float:
    """Median wall time of `call` (host launch and device run), synchronized each time."""
    for _ in range(3):
        call()
    timings = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        call()
        synchronize(device)
        timings.append(time.perf_counter() - start)
    return statistics.median(timings)


def measure_fused_ops(
    shape: Shape, dtype: torch.dtype, device: torch.device, lengths: tuple[int, ...]
) -> list[dict]:
    """Each Triton elementwise op against its eager reference at `lengths` tokens of `shape`."""
    from firsttoken.ops import triton_ops
    from firsttoken.ops.activation import silu_and_mul_reference
    from firsttoken.ops.norm import add_rms_norm_reference
    from firsttoken.ops.rotary import (
        apply_rotary_reference,
        cos_sin_table,
        inverse_frequencies,
        rotary_cos_sin,
    )

    table = cos_sin_table(inverse_frequencies(shape.head_dim, shape.rope_theta, None, None), max(lengths)).to(
        device
    )
    weight = torch.ones(shape.hidden_size, dtype=dtype, device=device)
    rows = []
    for length in lengths:
        hidden = torch.randn(length, shape.hidden_size, dtype=dtype, device=device)
        residual = torch.randn_like(hidden)
        gate_up = torch.randn(length, 2 * shape.intermediate_size, dtype=dtype, device=device)
        query_key = torch.randn(
            length, shape.num_heads + shape.num_kv_heads, shape.head_dim, dtype=dtype, device=device
        )
        cos, sin = rotary_cos_sin(table, torch.arange(length, device=device), dtype)
        pairs = {
            "add + rms_norm": (
                lambda: triton_ops.add_rms_norm(hidden, residual, weight, 1e-5),
                lambda: add_rms_norm_reference(hidden, residual, weight, 1e-5),
            ),
            "silu_and_mul": (
                lambda: triton_ops.silu_and_mul(gate_up),
                lambda: silu_and_mul_reference(gate_up),
            ),
            "rotary": (
                lambda: triton_ops.apply_rotary_(query_key, cos, sin),
                lambda: apply_rotary_reference(query_key, cos, sin),
            ),
        }
        for op, (fused, reference) in pairs.items():
            fused_s, reference_s = median_call_seconds(fused, device), median_call_seconds(reference, device)
            rows.append(
                {"op": op, "tokens": length, "triton_us": fused_s * 1e6, "reference_us": reference_s * 1e6,
                 "speedup": reference_s / fused_s}
            )
    return rows
