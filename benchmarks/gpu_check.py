"""Device check of the CUDA path, in one run: greedy parity with transformers on the same
weights, the bf16 matmul rate, TTFT against the compute floor and against a transformers
forward, TTFT and decode tokens/s with and without CUDA graphs, what capturing them cost, and
batch invariance: the same bits beside other requests, and what it costs.

    python benchmarks/gpu_check.py [--json results.json]          # on a CUDA machine, < 8 minutes on an H200
    python benchmarks/gpu_check.py --device cpu --tiny            # the same steps on tiny shapes, in seconds

Nothing is downloaded and firsttoken need not be installed (the repository root goes on
sys.path): models of the SmolLM2-135M and Llama-2-7B shapes get seeded random weights in
transformers, rounded to the run's dtype, are saved as Hugging Face folders (safetensors and a
word-level tokenizer.json) in a temporary folder, and firsttoken loads the same folders with
`LLM(folder, device=...)`. Prompts are random token ids.

Parity scores against transformers in float32 on those same (rounded) weights, not against its
bf16 forward, which on the 7B shape is itself several greedy tokens off float32: every greedy
token of ours must be the float32 argmax given the same context (one teacher-forced forward
over prompt + our tokens), except at near ties, where the float32 top two logits are within
bf16 rounding; and our first-token log-probs must be close to float32's. Exit status 1 on any
parity failure, else 0.
TTFT: wall time of `LLM.generate(max_tokens=1)` on a fresh prompt (median of 3 after a
warm-up), timed in turns with transformers' forward in the run's dtype on the same prompt
(logits of the last row only, as its generate prefills), against the floor: forward FLOPs /
the measured matmul rate. Each row is held to the device targets where the shape has them.
Graphs: the same TTFT prompts timed in turns on an engine that replays steps from graphs and
on one that runs them eagerly (fresh prompts on SDPA flash).
Decode: (batch x new tokens) / (time of a generate with them - time of one with 1 token).
Batch invariance (engines run with `batch_invariant=True`, the default, unless named plain): a
300-token prompt's greedy tokens and top-20 log-probs alone and beside 15 random prompts must be
the same bits wherever the engine claims invariance (exit status 1 if not); a plain engine
(`batch_invariant=False`: cuBLAS projections, SDPA prefills) is checked beside it for
comparison, and both are timed in turns: TTFT at 128/512/2048 tokens and decode tokens/s.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(BENCH_DIR))
sys.path.insert(0, BENCH_DIR)

from common import print_table  # noqa: E402

from firsttoken import LLM, SamplingParams  # noqa: E402

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

# Our dtype rounds where float32 does not: a greedy token may differ where the float32 top two
# logits are this close; beyond it a different token is a bug. Log-prob tolerance likewise.
NEAR_TIE = {torch.bfloat16: 0.25, torch.float32: 1e-3}
LOGPROB_TOLERANCE = {torch.bfloat16: 0.25, torch.float32: 1e-3}
# The batch-invariance check: a prompt alone, then beside this many random others.
INVARIANCE_OTHERS = 15
INVARIANCE_PROMPT_TOKENS = 300


# -- parity -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParityResult:
    """One prompt's greedy tokens checked against transformers."""

    shape: str
    prompt_tokens: int
    cached_tokens: int  # prompt tokens read from the prefix cache (then computed as a chunk on them)
    new_tokens: int
    same_as_reference_greedy: int  # leading tokens equal to transformers' float32 greedy run
    near_ties: int
    clear_misses: int
    first_token_logprob_error: float
    logprob_tolerance: float

    @property
    def passed(self) -> bool:
        return self.clear_misses == 0 and self.first_token_logprob_error <= self.logprob_tolerance


def count_misses(our_tokens: list[int], reference_logits: torch.Tensor, near_tie: float) -> tuple[int, int]:
    """(near ties, clear misses): positions where our token is not the reference argmax, split by
    whether the reference's best logit beats its logit of our token by at most `near_tie`.

    reference_logits [len(our_tokens), vocab]: row i given the prompt and our tokens before i.
    """
    near_ties = clear_misses = 0
    for position, token in enumerate(our_tokens):
        row = reference_logits[position]
        best = int(row.argmax())
        if token == best:
            continue
        if float(row[best] - row[token]) <= near_tie:
            near_ties += 1
        else:
            clear_misses += 1
    return near_ties, clear_misses


def leading_matches(ours: list[int], reference: list[int]) -> int:
    count = 0
    for ours_token, reference_token in zip(ours, reference):
        if ours_token != reference_token:
            break
        count += 1
    return count


def exit_status(parity: list[ParityResult], invariance: list[dict]) -> int:
    """1 on a parity failure, where an engine claims batch invariance and a row's bits moved, or
    where an engine that must claim it (the invariant one on CUDA) does not."""
    invariant = all(
        row["same_bits_beside_others"] if row["claimed"] else not row["must_claim"] for row in invariance
    )
    return 0 if parity and all(result.passed for result in parity) and invariant else 1


def check_parity(
    llm: LLM, hf_model: Any, shape: Shape, plan: Plan, device: torch.device, seed: int
) -> list[ParityResult]:
    """Prompts in two rounds; the second's first prompt shares 512 tokens (or half) of the first
    round's longest, so it is computed as a chunk on cached context."""
    first_round = [
        random_prompt(length, f"parity-{seed}-{length}", shape.vocab_size) for length in plan.parity_lengths
    ]
    longest = max(first_round, key=len)
    shared = min(512, len(longest) // 2)
    second_round = [longest[:shared] + random_prompt(40, f"parity-{seed}-tail", shape.vocab_size)]
    params = SamplingParams(temperature=0, max_tokens=plan.parity_new_tokens, ignore_eos=True, logprobs=5)
    results = []
    for prompts in (first_round, second_round):
        for prompt, output in zip(prompts, llm.generate(prompt_token_ids=prompts, sampling_params=params)):
            results.append(_parity_of(hf_model, shape, plan, device, prompt, output))
    return results


@torch.inference_mode()
def _parity_of(
    hf_model: Any, shape: Shape, plan: Plan, device: torch.device, prompt: list[int], output
) -> ParityResult:
    ours = output.token_ids
    sequence = torch.tensor([prompt + ours[:-1]], device=device)
    logits = hf_model(sequence).logits[0, len(prompt) - 1 :].float().cpu()
    near_ties, clear_misses = count_misses(ours, logits, NEAR_TIE[plan.dtype])
    reference_logprobs = torch.log_softmax(logits[0], dim=-1)
    first_error = max(
        abs(alternative.logprob - float(reference_logprobs[alternative.token_id]))
        for alternative in output.logprobs[0].top_logprobs
    )
    generated = hf_model.generate(
        torch.tensor([prompt], device=device),
        max_new_tokens=len(ours),
        do_sample=False,
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=device),
        pad_token_id=0,
    )
    reference_greedy = generated[0, len(prompt) :].tolist()
    return ParityResult(
        shape=shape.name,
        prompt_tokens=len(prompt),
        cached_tokens=output.num_cached_tokens,
        new_tokens=len(ours),
        same_as_reference_greedy=leading_matches(ours, reference_greedy),
        near_ties=near_ties,
        clear_misses=clear_misses,
        first_token_logprob_error=first_error,
        logprob_tolerance=LOGPROB_TOLERANCE[plan.dtype],
    )


# -- speed ------------------------------------------------------------------------------------


def random_prompt(num_tokens: int, key: str, vocab_size: int) -> list[int]:
    """Token ids seeded by `key`: distinct keys give prompts no prefix cache has seen."""
    rng = random.Random(key)
    return [rng.randrange(3, vocab_size) for _ in range(num_tokens)]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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


def timed_generate(llm: LLM, prompts: list[list[int]], max_tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompt_token_ids=prompts, sampling_params=params)
    return time.perf_counter() - start


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


# -- batch invariance ------------------------------------------------------------------------


def _output_bits(output) -> tuple:
    """A completion's tokens and every top log-prob, as exact floats: the logits' bits as far as
    the output shows them."""
    return tuple(output.token_ids), tuple(
        (entry.logprob, tuple((alt.token_id, alt.logprob) for alt in entry.top_logprobs))
        for entry in output.logprobs
    )


def same_bits_beside_others(llm: LLM, shape: Shape, plan: Plan, seed: int) -> bool:
    """Whether a prompt's greedy tokens and top-20 log-probs are the same bits alone as beside
    INVARIANCE_OTHERS random prompts of 1 to 600 tokens, which share its prefill step, then its
    decode steps (the second run also reads the prompt's cached prefix blocks)."""
    params = SamplingParams(
        temperature=0, max_tokens=plan.invariance_new_tokens, ignore_eos=True, logprobs=20
    )
    target = random_prompt(
        min(INVARIANCE_PROMPT_TOKENS, max(plan.ttft_lengths)), f"invariance-{seed}", shape.vocab_size
    )
    rng = random.Random(seed)
    others = [
        random_prompt(rng.randrange(1, 2 * len(target)), f"invariance-{seed}-other-{i}", shape.vocab_size)
        for i in range(INVARIANCE_OTHERS)
    ]
    alone = llm.generate(prompt_token_ids=[target], sampling_params=params)[0]
    beside = llm.generate(prompt_token_ids=others[:7] + [target] + others[7:], sampling_params=params)[7]
    return _output_bits(alone) == _output_bits(beside)


def check_batch_invariance(
    invariant: LLM, plain: LLM, shape: Shape, plan: Plan, device: torch.device, seed: int
) -> list[dict]:
    """Per engine: whether it claims invariance (the invariant one must, on CUDA), and whether
    a prompt's bits held beside others."""
    return [
        {
            "engine": name,
            "claimed": llm.inspect().batch_invariant,
            "must_claim": name == "invariant" and device.type == "cuda",
            "same_bits_beside_others": same_bits_beside_others(llm, shape, plan, seed),
        }
        for name, llm in (("invariant", invariant), ("plain", plain))
    ]


def measure_invariance_ttft(
    invariant: LLM, plain: LLM, shape: Shape, plan: Plan, device: torch.device, seed: int
) -> list[dict]:
    """TTFT with invariance on and off, timed in turns on the same prompts (median of 3 after a warm-up)."""
    rows = []
    for length in plan.invariance_lengths:
        if length >= shape.max_position_embeddings:
            continue
        timings: dict[str, list[float]] = {"invariant": [], "plain": []}
        for run in range(4):
            prompt = random_prompt(length, f"invariance-ttft-{seed}-{length}-{run}", shape.vocab_size)
            for name, llm in (("invariant", invariant), ("plain", plain)):
                synchronize(device)
                timings[name].append(timed_generate(llm, [prompt], 1))
        invariant_s, plain_s = (statistics.median(timings[name][1:]) for name in ("invariant", "plain"))
        rows.append(
            {
                "prompt_tokens": length,
                "invariant_s": invariant_s,
                "plain_s": plain_s,
                "ratio": invariant_s / plain_s,
            }
        )
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


# -- models ------------------------------------------------------------------------------------


def build_reference(shape: Shape, dtype: torch.dtype, device: torch.device, seed: int) -> Any:
    """transformers' Llama of this shape with seeded random weights, on `device`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        max_position_embeddings=shape.max_position_embeddings,
        rope_theta=shape.rope_theta,
        rms_norm_eps=1e-5,
        tie_word_embeddings=shape.tie_word_embeddings,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    return model.to(dtype).eval()


def save_folder(hf_model: Any, shape: Shape, folder: str) -> str:
    """The model as a Hugging Face folder, with a word-level tokenizer over its vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    hf_model.save_pretrained(folder)
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(shape.vocab_size)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(os.path.join(folder, "tokenizer.json"))
    return folder


def open_engine(
    folder: str,
    shape: Shape,
    plan: Plan,
    device: torch.device,
    cuda_graphs: bool,
    batch_invariant: bool = True,
) -> LLM:
    longest = max(max(plan.ttft_lengths), max(plan.parity_lengths) + plan.parity_new_tokens)
    kv_tokens = 3 * longest + max(plan.decode_batches) * (plan.decode_prompt_tokens + plan.decode_new_tokens)
    return LLM(
        folder,
        device=device.type,
        dtype=str(plan.dtype).removeprefix("torch."),
        cuda_graphs=cuda_graphs,
        kv_cache_memory_bytes=kv_tokens * shape.kv_bytes_per_token(plan.dtype),
        chunk_size=longest,
        max_num_batched_tokens=longest,
        max_num_seqs=max(plan.decode_batches),
        max_model_len=shape.max_position_embeddings,
        batch_invariant=batch_invariant,
    )


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# -- the run -----------------------------------------------------------------------------------


def run(
    plan: Plan, device: torch.device, workdir: str, seed: int, say: Callable[[str], None]
) -> tuple[dict, list[ParityResult]]:
    results: dict[str, Any] = {"parity": [], "ttft": [], "decode": [], "graph_capture": [], "graphs_ttft": [],
                               "batch_invariance": [], "invariance_ttft": []}
    all_parity: list[ParityResult] = []
    results["matmul_tflops"] = tflops = matmul_tflops(plan.matmul_size, plan.dtype, device)
    dtype_name = str(plan.dtype).removeprefix("torch.")
    say(f"{dtype_name} matmul {plan.matmul_size}^3: {tflops:.1f} TFLOP/s (median of 10)")
    if device.type == "cuda":
        fused = measure_fused_ops(plan.shapes[-1], plan.dtype, device, (16, 512, 4096))
        results["fused_ops"] = fused
        say(
            f"elementwise ops of the {plan.shapes[-1].name} shape: Triton kernel vs eager reference (median "
            "of 50)"
        )
        print_table(
            ["op", "tokens", "triton us", "reference us", "speed-up"],
            [[r["op"], r["tokens"], r["triton_us"], r["reference_us"], r["speedup"]] for r in fused],
        )
    for index, shape in enumerate(plan.shapes):
        started = time.perf_counter()
        hf_model = build_reference(shape, plan.dtype, device, seed + index)
        folder = save_folder(hf_model, shape, os.path.join(workdir, shape.name))
        llm = open_engine(folder, shape, plan, device, cuda_graphs=device.type == "cuda")
        say(
            f"\n== {shape.name}: weights seeded, saved and loaded in {time.perf_counter() - started:.1f} s; "
            f"{llm.inspect().description}, {llm.stats().num_kv_blocks} KV blocks"
        )
        capture = llm.inspect().graph_capture
        if capture is not None:
            results["graph_capture"].append({"shape": shape.name} | asdict(capture))
            say(
                f"graphs for decode batch sizes {list(capture.batch_sizes)} and step token counts "
                f"{list(capture.token_sizes)} captured at start-up in {capture.seconds:.2f} s, "
                f"{capture.device_memory_bytes / 2**20:.0f} MiB of device memory"
            )
        # Float32 on the engine's own (rounded) weights: the reference parity is scored against.
        hf_model.float()
        parity = check_parity(llm, hf_model, shape, plan, device, seed)
        all_parity += parity
        results["parity"] += [asdict(result) | {"passed": result.passed} for result in parity]
        say("greedy parity against transformers float32 on the same weights")
        print_table(
            [
                "prompt",
                "cached",
                "new",
                "same as fp32 greedy",
                "near ties",
                "clear misses",
                "first-token |dlogprob|",
                "ok",
            ],
            [
                [
                    r.prompt_tokens,
                    r.cached_tokens,
                    r.new_tokens,
                    r.same_as_reference_greedy,
                    r.near_ties,
                    r.clear_misses,
                    r.first_token_logprob_error,
                    "yes" if r.passed else "NO",
                ]
                for r in parity
            ],
        )
        hf_model.to(plan.dtype)  # exact: the weights were rounded to it
        release(device)
        ttft = measure_ttft(llm, hf_model, shape, plan, tflops, device, seed)
        results["ttft"] += [{"shape": shape.name} | row for row in ttft]
        say(f"TTFT (median of 3 after a warm-up), timed in turns with transformers' {dtype_name} forward")
        print_table(
            [
                "prompt tokens",
                "ttft ms",
                "floor ms",
                "x floor",
                "transformers ms",
                "speed-up",
                "target",
                "meets",
            ],
            [
                [
                    r["prompt_tokens"],
                    r["ttft_s"] * 1e3,
                    r["floor_s"] * 1e3,
                    r["ratio"],
                    r["transformers_s"] * 1e3,
                    r["speedup_over_transformers"],
                    r["target"],
                    {True: "yes", False: "no", None: "-"}[r["meets_targets"]],
                ]
                for r in ttft
            ],
        )
        del hf_model
        release(device)
        graphs = device.type == "cuda"
        plain = open_engine(folder, shape, plan, device, cuda_graphs=graphs, batch_invariant=False)
        invariance = check_batch_invariance(llm, plain, shape, plan, device, seed)
        results["batch_invariance"] += [{"shape": shape.name} | row for row in invariance]
        say(f"batch invariance: a prompt alone and beside {INVARIANCE_OTHERS} others, every log-prob bit")
        print_table(
            ["engine", "claims invariance", "same bits beside others"],
            [[r["engine"], r["claimed"], r["same_bits_beside_others"]] for r in invariance],
        )
        invariance_ttft = measure_invariance_ttft(llm, plain, shape, plan, device, seed)
        results["invariance_ttft"] += [{"shape": shape.name} | row for row in invariance_ttft]
        say("TTFT with batch_invariant on and off, timed in turns (median of 3 after a warm-up)")
        print_table(
            ["prompt tokens", "invariant ms", "plain ms", "invariant / plain"],
            [
                [r["prompt_tokens"], r["invariant_s"] * 1e3, r["plain_s"] * 1e3, r["ratio"]]
                for r in invariance_ttft
            ],
        )
        decode_rows = [
            {"shape": shape.name, "cuda_graphs": graphs, "batch_invariant": True} | row
            for row in measure_decode(llm, shape, plan, seed)
        ]
        decode_rows += [
            {"shape": shape.name, "cuda_graphs": graphs, "batch_invariant": False} | row
            for row in measure_decode(plain, shape, plan, seed)
        ]
        del plain
        release(device)
        if graphs:
            eager = open_engine(folder, shape, plan, device, cuda_graphs=False)
            decode_rows += [
                {"shape": shape.name, "cuda_graphs": False, "batch_invariant": True} | row
                for row in measure_decode(eager, shape, plan, seed)
            ]
            graph_rows = compare_graphs(llm, eager, shape, plan, seed)
            results["graphs_ttft"] += [{"shape": shape.name} | row for row in graph_rows]
            say("TTFT (median of 3 after a warm-up): steps replayed from graphs vs run eagerly, in turns")
            print_table(
                ["prompt tokens", "graphs ms", "eager ms", "speed-up"],
                [
                    [r["prompt_tokens"], r["graphs_s"] * 1e3, r["eager_s"] * 1e3, r["speedup"]]
                    for r in graph_rows
                ],
            )
            del eager
        del llm
        release(device)
        results["decode"] += decode_rows
        lengths = f"{plan.decode_prompt_tokens}-token prompts, {plan.decode_new_tokens} new tokens each"
        say(f"decode tokens/s ({lengths})")
        print_table(
            ["batch", "cuda graphs", "batch invariant", "tokens/s"],
            [[r["batch"], r["cuda_graphs"], r["batch_invariant"], r["tokens_per_s"]] for r in decode_rows],
        )
    return results, all_parity


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes and lengths, float32 (a smoke run)")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--workdir", help="where the model folders go (default: a temporary folder)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu --tiny for the CPU smoke run", file=sys.stderr)
        return 2
    plan = TINY_PLAN if args.tiny else FULL_PLAN

    def say(text: str) -> None:
        print(text, flush=True)

    import transformers

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    say(
        f"firsttoken device check: torch {torch.__version__}, transformers {transformers.__version__}, {name}"
    )
    started = time.perf_counter()
    if args.workdir is not None:
        os.makedirs(args.workdir, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.workdir) as workdir:
        results, parity = run(plan, device, workdir, args.seed, say)
    status = exit_status(parity, results["batch_invariance"])
    results |= {
        "device": name,
        "torch": torch.__version__,
        "seconds": time.perf_counter() - started,
        "exit_status": status,
    }
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(results, handle, indent=2)
    failures = sum(1 for result in parity if not result.passed)
    missed = [f"{r['shape']} {r['prompt_tokens']}" for r in results["ttft"] if r["meets_targets"] is False]
    claimed = [r for r in results["batch_invariance"] if r["claimed"]]
    moved = [r["shape"] for r in claimed if not r["same_bits_beside_others"]]
    unclaimed = [r["shape"] for r in results["batch_invariance"] if r["must_claim"] and not r["claimed"]]
    invariance = (
        "held" if claimed and not moved else "not claimed" if not claimed else "BROKEN on " + ", ".join(moved)
    )
    if unclaimed:
        invariance += "; NOT CLAIMED on " + ", ".join(unclaimed)
    say(
        f"\nRESULT: parity {'ok' if failures == 0 and parity else f'FAILED ({failures} prompts)'}; "
        f"batch invariance {invariance}; "
        f"TTFT targets {'met' if not missed else 'missed at ' + ', '.join(missed)}; "
        f"{results['seconds']:.0f} s in all"
    )
    return status


if __name__ == "__main__":
    sys.exit(main())
