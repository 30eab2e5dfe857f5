"""Every compute form (dtype x batch invariance) on this machine: what the start-up probe
predicts for each, what `auto` picks from it, and what engines in each form measure.

    python benchmarks/compute_forms.py [--model PATH] [--input-len 512] [--decode-tokens 32] \\
        [--repeats 5] [--probe-only]

The probe is the one `dtype="auto"` and `batch_invariant="auto"` run at start: a one-layer model
of the checkpoint's shapes with random weights in each form, a prefill of the probe's length and a
one-row decode step, extrapolated to the whole model. Then one engine per form (the real weights,
that dtype and invariance fixed) is timed in turns: TTFT of a fresh `--input-len`-token prompt
alone, and TPOT of one stream. Prints each form's figures with its ratio to the fastest and the
probe's prediction over the engine's measurement (the probe's random weights hold no GGUF levels,
which float32 decode steps read: its float32 decode is pessimistic there). The JSON goes to
bench_results/. `ONEDNN_MAX_CPU_ISA=AVX512_CORE` (oneDNN without bf16 instructions) or
`AVX512_CORE_BF16` (without AMX) reproduce other CPU classes on a machine that has more.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import interleaved_medians, print_table, random_prompt, save_result, timed  # noqa: E402

from firsttoken import LLM, SamplingParams  # noqa: E402
from firsttoken.config import AttentionConfig  # noqa: E402
from firsttoken.models.loaders.conversion_cache import default_cache_dir  # noqa: E402
from firsttoken.models.registry import open_checkpoint, resolve_model_path  # noqa: E402
from firsttoken.ops.cpu_info import cpu_flags, cpu_model_name  # noqa: E402
from firsttoken.ops.linear import cpu_computes_bf16  # noqa: E402
from firsttoken.ops.native import load_native_kernels  # noqa: E402
from firsttoken.worker.compute_choice import ComputeRequest, candidate_forms, choose_form  # noqa: E402
from firsttoken.worker.compute_probe import measure_forms, probe_tokens  # noqa: E402

FIRST_TOKEN = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
AUTO = ComputeRequest("auto", "auto")


def probe(model: str | None, max_tokens: int):
    """Each candidate form's predicted prefill and decode, and the length the probe prefilled."""
    cache_dir = default_cache_dir()
    checkpoint = open_checkpoint(resolve_model_path(model), cache_dir)
    native_kernels = load_native_kernels(os.path.join(cache_dir, "native"))
    if native_kernels is None:
        sys.exit("no native kernels here (no working C compiler): the probe runs on them")
    tokens = probe_tokens(checkpoint.arch, max_tokens)
    forms = candidate_forms(AUTO, cpu_computes_bf16())
    timings = measure_forms(
        forms, checkpoint.arch, checkpoint.rope_frequency_divisors, native_kernels, AttentionConfig(), tokens
    )
    return timings, tokens


def engine_figures(model: str | None, forms, input_len: int, decode_tokens: int, repeats: int):
    """By form label: (TTFT s, TPOT s) of an engine in that form, medians taken in turns."""
    engines = {
        form.label: LLM(
            model,
            dtype=form.dtype,
            batch_invariant=form.batch_invariant,
            enable_prompt_cache=False,
            kv_cache_memory_bytes=256 << 20,
            chunk_size=max(input_len, 16),
        )
        for form in forms
    }
    ttft_runs = {
        label: (
            lambda index, llm=llm: timed(
                lambda: llm.generate(
                    prompt_token_ids=[random_prompt(input_len, seed=index)], sampling_params=FIRST_TOKEN
                )
            )
        )
        for label, llm in engines.items()
    }
    ttft = interleaved_medians(ttft_runs, repeats)
    stream = SamplingParams(temperature=0, max_tokens=decode_tokens + 1, ignore_eos=True)
    decode_runs = {
        label: (
            lambda index, llm=llm: timed(
                lambda: llm.generate(
                    prompt_token_ids=[random_prompt(input_len, seed=1000 + index)], sampling_params=stream
                )
            )
        )
        for label, llm in engines.items()
    }
    whole = interleaved_medians(decode_runs, repeats)
    for llm in engines.values():
        llm.shutdown()
    return {label: (ttft[label], max(whole[label] - ttft[label], 0.0) / decode_tokens) for label in engines}


def ratio(value: float, baseline: float) -> float:
    """value / baseline; NaN where the baseline is 0 (a TPOT lost in a short run's noise)."""
    return value / baseline if baseline > 0 else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--probe-only", action="store_true", help="the probe's figures, no engines")
    args = parser.parse_args()
    timings, tokens = probe(args.model, args.input_len)
    choice = choose_form(AUTO, timings, tokens)
    flags = sorted(flag for flag in cpu_flags() if flag.startswith(("avx", "amx")))
    onednn_isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "")
    print(f"{cpu_model_name()}; {' '.join(flags)}; ONEDNN_MAX_CPU_ISA={onednn_isa}")
    print(f"probe: a one-layer model, a {tokens}-token prefill and a one-row decode, extrapolated\n")
    fastest_prefill = min(timing.prefill_s for timing in timings)
    fastest_decode = min(timing.decode_s for timing in timings)
    rows = [
        [
            timing.form.label,
            timing.prefill_s * 1e3,
            timing.prefill_s / fastest_prefill,
            timing.decode_s * 1e3,
            timing.decode_s / fastest_decode,
        ]
        for timing in timings
    ]
    print_table(["form (probe)", "prefill ms", "/ fastest", "decode step ms", "/ fastest"], rows)
    print(f"\nauto picks: {choice.dtype}, invariance {'on' if choice.batch_invariant else 'off'}")
    print(f"  {choice.dtype_reason}\n  {choice.invariance_reason}")
    payload = {
        "cpu": cpu_model_name(),
        "flags": flags,
        "onednn_max_cpu_isa": onednn_isa,
        "probe_tokens": tokens,
        "probe": {
            t.form.label: {"prefill_ms": t.prefill_s * 1e3, "decode_ms": t.decode_s * 1e3} for t in timings
        },
        "choice": {"dtype": choice.dtype, "batch_invariant": choice.batch_invariant},
    }
    if not args.probe_only:
        measured = engine_figures(
            args.model, [t.form for t in timings], args.input_len, args.decode_tokens, args.repeats
        )
        best_ttft = min(ttft for ttft, _ in measured.values())
        best_tpot = min(tpot for _, tpot in measured.values())
        rows = []
        for timing in timings:
            ttft, tpot = measured[timing.form.label]
            probe_vs_engine = timing.prefill_s / ttft if tokens == args.input_len else float("nan")
            rows.append(
                [
                    timing.form.label,
                    ttft * 1e3,
                    ratio(ttft, best_ttft),
                    tpot * 1e3,
                    ratio(tpot, best_tpot),
                    probe_vs_engine,
                    ratio(timing.decode_s, tpot),
                ]
            )
        print(
            f"\nengines: TTFT of a {args.input_len}-token prompt, one stream's TPOT,"
            f" medians of {args.repeats}"
        )
        print_table(
            [
                "form (engine)",
                "TTFT ms",
                "/ best",
                "TPOT ms",
                "/ best",
                "probe/engine prefill",
                "probe/engine decode",
            ],
            rows,
        )
        payload["engines"] = {
            label: {"ttft_ms": t * 1e3, "tpot_ms": d * 1e3} for label, (t, d) in measured.items()
        }
    print(f"\nsaved {save_result('compute_forms', payload)}")


if __name__ == "__main__":
    main()
