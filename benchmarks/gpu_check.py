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
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict
from typing import Any, Callable

import torch

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(BENCH_DIR))
sys.path.insert(0, BENCH_DIR)

# The steps sit beside this file in gpu_check_*.py, split by what each measures; they import
# each other and firsttoken through the two paths above.
from common import print_table  # noqa: E402
from gpu_check_invariance import (  # noqa: E402
    INVARIANCE_OTHERS,
    check_batch_invariance,
    measure_invariance_ttft,
)
from gpu_check_models import build_reference, open_engine, release, save_folder  # noqa: E402
from gpu_check_parity import ParityResult, check_parity  # noqa: E402
from gpu_check_plan import FULL_PLAN, TINY_PLAN, Plan  # noqa: E402
from gpu_check_speed import (  # noqa: E402
    compare_graphs,
    matmul_tflops,
    measure_decode,
    measure_fused_ops,
    measure_ttft,
)


def exit_status(parity: list[ParityResult], invariance: list[dict]) -> int:
    """1 on a parity failure, where an engine claims batch invariance and a row's bits moved, or
    where an engine that must claim it (the invariant one on CUDA) does not."""
    invariant = all(
        row["same_bits_beside_others"] if row["claimed"] else not row["must_claim"] for row in invariance
    )
    return 0 if parity and all(result.passed for result in parity) and invariant else 1


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
