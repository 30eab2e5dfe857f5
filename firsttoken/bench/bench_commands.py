"""The `firsttoken bench latency | serve | compare`, `firsttoken profile` and `firsttoken tune` verbs.

Engine options are flags of every verb that starts an engine (`add_engine_args`); the heavy
modules load only when a verb runs, so `firsttoken --help` stays fast.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Any

from firsttoken.engine_args import add_engine_args, add_model_arg, engine_kwargs
from firsttoken.progress import add_no_progress_arg, announce_engine_start, progress_wanted

COMPARE_DESCRIPTION = (
    "TTFT and decode tokens/s of firsttoken, transformers and (when installed) llama.cpp on the same "
    "prompts in one run, with ratios. --dtype defaults to float32 here and applies to transformers too; "
    "llama.cpp runs the GGUF weights as stored."
)
TUNE_DESCRIPTION = (
    "Serves the workload on a `firsttoken serve` process per setting of the search grid, at Poisson "
    "rates that double while the TTFT objective holds (P99 over every request sent, a refused or failed "
    "one counting as a miss) and then bisect; reports each setting's highest rate kept, plots P99 TTFT "
    "by rate, and writes the best setting as a config file for `firsttoken serve --config FILE`. Engine "
    "flags given here apply to every setting."
)
DEFAULT_TUNE_SEARCH = ["chunk_size=auto,256,1024", "quantization=none,int4"]
# Offline benchmarks measure full prefills: distinct prompts, and no reuse across runs.
_BENCH_ENGINE_DEFAULTS: dict[str, Any] = {"enable_prompt_cache": False}
MAX_PORT = 65535


def register_bench_verbs(verbs: argparse._SubParsersAction) -> None:
    """Add `bench` (with latency, serve, compare) and `profile` to the top-level verbs."""
    bench = verbs.add_parser("bench", help="benchmarks: offline latency, serving load, peer comparison")
    bench_verbs = bench.add_subparsers(dest="bench_verb", required=True, metavar="BENCHMARK")

    latency = bench_verbs.add_parser(
        "latency", help="TTFT, TPOT, end-to-end and token rates of one batch, offline"
    )
    add_model_arg(latency)
    latency.add_argument(
        "--input-len", type=int, default=512, help="prompt tokens per request (default: 512)"
    )
    latency.add_argument(
        "--output-len", type=int, default=128, help="tokens generated per request (default: 128)"
    )
    latency.add_argument("--batch-size", type=int, default=1, help="requests per batch (default: 1)")
    _add_run_args(latency, runs=5)
    latency.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    add_engine_args(latency)
    latency.set_defaults(handler=run_latency)

    serve = bench_verbs.add_parser(
        "serve", help="load an OpenAI-compatible server and measure TTFT, TPOT, ITL, goodput"
    )
    add_serve_args(serve)
    serve.set_defaults(handler=run_serve)

    compare = bench_verbs.add_parser(
        "compare",
        help="firsttoken vs transformers (and llama.cpp) on the same prompts",
        description=COMPARE_DESCRIPTION,
    )
    add_compare_args(compare)
    compare.set_defaults(handler=run_compare)

    profile = verbs.add_parser(
        "profile", help="TTFT statistics and a measured per-stage breakdown of one request"
    )
    add_model_arg(profile)
    profile.add_argument("--input-len", type=int, default=512, help="prompt tokens (default: 512)")
    _add_run_args(profile, runs=10)
    profile.add_argument(
        "--trace", default=None, metavar="PATH", help="write a PyTorch profiler Chrome trace of one request"
    )
    profile.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object (ttft_ms, stages_ms, ...) instead of the table",
    )
    add_engine_args(profile)
    profile.set_defaults(handler=run_profile)

    tune = verbs.add_parser(
        "tune",
        help="find the engine settings that serve a workload at the highest rate within a TTFT objective",
        description=TUNE_DESCRIPTION,
    )
    add_tune_args(tune)
    tune.set_defaults(handler=run_tune)


def add_tune_args(parser: argparse.ArgumentParser) -> None:
    add_model_arg(parser)
    objective = parser.add_argument_group("objective and workload")
    objective.add_argument(
        "--ttft-p99-ms", type=float, required=True, help="the objective: P99 TTFT in ms, at the client"
    )
    objective.add_argument("--input-len", type=int, default=512, help="prompt tokens (default: 512)")
    objective.add_argument("--output-len", type=int, default=64, help="tokens generated (default: 64)")
    objective.add_argument(
        "--num-prompts", type=int, default=30, help="requests sent at each rate (default: 30)"
    )
    objective.add_argument("--seed", type=int, default=0, help="seed of prompts and arrivals (default: 0)")
    search = parser.add_argument_group("search")
    search.add_argument(
        "--search",
        nargs="+",
        default=DEFAULT_TUNE_SEARCH,
        metavar="NAME=V1,V2",
        help="engine options and the values to try, every combination (`none`: the default); e.g. "
        "max_num_seqs=8,32 speculative_method=none,ngram (default: " + " ".join(DEFAULT_TUNE_SEARCH) + ")",
    )
    search.add_argument(
        "--start-rate", type=float, default=0.25, help="first rate probed, req/s (default: 0.25)"
    )
    search.add_argument(
        "--max-probes", type=int, default=5, help="rates probed per setting (default: 5)"
    )
    servers = parser.add_argument_group("servers")
    servers.add_argument(
        "--host", default="127.0.0.1", help="address the servers listen on (default: 127.0.0.1)"
    )
    servers.add_argument(
        "--port",
        type=_port,
        default=None,
        help="TCP port of the servers, which run one at a time (default: a free port each)",
    )
    output = parser.add_argument_group("output")
    output.add_argument(
        "--output", default="tuned.json", help="the best setting's config file (default: tuned.json)"
    )
    output.add_argument(
        "--result-dir", default=None, help="folder for the JSON result and the plot (default: bench_results)"
    )
    add_no_progress_arg(output)
    add_engine_args(parser)


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from error
    if not 1 <= port <= MAX_PORT:
        raise argparse.ArgumentTypeError(f"must be in [1, {MAX_PORT}], got {port}")
    return port


def run_tune(args: argparse.Namespace) -> int:
    import json

    from firsttoken.bench.plots import write_tune_plot
    from firsttoken.bench.results import result_stem, write_json
    from firsttoken.bench.tune import (
        best_result,
        format_results,
        parse_search,
        results_payload,
        tune,
    )
    from firsttoken.bench.tune_progress import TuneProgress
    from firsttoken.bench.tune_served import ServedTrials, Workload
    from firsttoken.config import EngineConfig

    if not args.ttft_p99_ms > 0:
        raise ValueError(f"ttft_p99_ms: must be > 0, got {args.ttft_p99_ms}")
    if args.start_rate <= 0 or args.max_probes < 1 or args.num_prompts < 1:
        raise ValueError("start_rate, max_probes and num_prompts: must be > 0")
    base_options = engine_kwargs(args)
    settings = parse_search(args.search)
    for setting in settings:  # a typo fails now, not after an hour of other settings
        EngineConfig.from_kwargs(**{**base_options, **setting.as_dict})
    workload = Workload(args.input_len, args.output_len, args.num_prompts, args.seed)
    trials = ServedTrials(
        args.model, base_options, workload, args.ttft_p99_ms, _prompt_tokenizer(None), args.host, args.port,
        progress_wanted(args.no_progress),
    )  # fmt: skip
    progress = TuneProgress(len(settings), args.max_probes, args.ttft_p99_ms)
    progress.plan(args.num_prompts, args.output_len, args.start_rate)
    try:
        results = tune(
            settings, trials, args.start_rate, args.max_probes,
            on_probe=progress.probe_ended, on_setting=progress.setting_started,
        )  # fmt: skip
    finally:
        trials.close()
    print(format_results(results, args.ttft_p99_ms))
    stem = result_stem(args.result_dir, "tune")
    saved = [
        write_json(stem + ".json", results_payload(results, args.ttft_p99_ms)),
        write_tune_plot(results, args.ttft_p99_ms, stem + "_p99_by_rate.png"),
    ]
    print("saved " + " ".join(saved), file=sys.stderr)
    best = best_result(results)
    if best is None:
        print("no setting kept the objective at any rate probed: lower --start-rate", file=sys.stderr)
        return 1
    chosen = {**base_options, **best.setting.as_dict}
    options = {name: value for name, value in chosen.items() if value is not None}
    with open(args.output, "w", encoding="utf-8") as handle:
        json.dump(options, handle, indent=2)
        handle.write("\n")
    print(f"best: {best.setting.label} at {best.best_rate:.3g} req/s; wrote {args.output} "
          f"(firsttoken serve --config {args.output})")
    return 0


def _add_run_args(parser: argparse.ArgumentParser, runs: int) -> None:
    parser.add_argument("--runs", type=int, default=runs, help=f"timed runs (default: {runs})")
    parser.add_argument("--warmup-runs", type=int, default=1, help="untimed runs first (default: 1)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompt texts (default: 0)")
    add_no_progress_arg(parser)


def add_compare_args(parser: argparse.ArgumentParser) -> None:
    add_model_arg(parser)
    parser.add_argument(
        "--input-lens",
        type=int,
        nargs="+",
        default=[128, 512],
        help="prompt lengths in tokens (default: 128 512)",
    )
    parser.add_argument(
        "--output-len", type=int, default=32, help="tokens generated per request (default: 32)"
    )
    _add_run_args(parser, runs=3)
    parser.add_argument(
        "--no-llama-cpp", action="store_true", help="leave llama.cpp out even when llama_cpp is installed"
    )
    parser.add_argument(
        "--result-dir", default=None, help="folder for the JSON result (default: bench_results)"
    )
    add_engine_args(parser)


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    target = parser.add_argument_group("server")
    target.add_argument("--base-url", required=True, help="the server's root, e.g. http://127.0.0.1:8000")
    target.add_argument(
        "--endpoint",
        default="/v1/completions",
        choices=["/v1/completions", "/v1/chat/completions"],
        help="API to call (default: /v1/completions)",
    )
    target.add_argument(
        "--model", default=None, help="model name sent in requests (default: the first of GET /v1/models)"
    )
    target.add_argument(
        "--ignore-eos", action="store_true", help="ask the server to generate exactly --output-len tokens"
    )
    target.add_argument(
        "--timeout-s",
        type=float,
        default=600.0,
        help="longest wait in seconds to connect or for the next bytes of a reply (default: 600)",
    )

    data = parser.add_argument_group("dataset")
    data.add_argument(
        "--dataset",
        default="random",
        choices=["random", "shared-prefix", "mixed-long"],
        help="request set (default: random)",
    )
    data.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help="requests to send (default: 100; shared-prefix sends groups x prompts per group)",
    )
    data.add_argument(
        "--input-len",
        type=int,
        default=256,
        help="prompt tokens; after the prefix for shared-prefix (default: 256)",
    )
    data.add_argument("--output-len", type=int, default=128, help="max tokens per request (default: 128)")
    data.add_argument(
        "--range-ratio",
        type=float,
        default=0.0,
        help="prompt lengths vary uniformly by this fraction (default: 0)",
    )
    data.add_argument("--prefix-groups", type=int, default=4, help="shared-prefix: G groups (default: 4)")
    data.add_argument(
        "--prompts-per-group", type=int, default=8, help="shared-prefix: P prompts per group (default: 8)"
    )
    data.add_argument(
        "--prefix-len",
        type=int,
        default=512,
        help="shared-prefix: S tokens of shared system prompt (default: 512)",
    )
    data.add_argument(
        "--long-fraction", type=float, default=0.1, help="mixed-long: share of long prompts (default: 0.1)"
    )
    data.add_argument(
        "--long-input-len", type=int, default=2048, help="mixed-long: tokens of a long prompt (default: 2048)"
    )
    data.add_argument(
        "--tokenizer",
        default=None,
        metavar="PATH",
        help="GGUF file or HF folder whose tokenizer sizes the prompts exactly; 'none' counts one token "
        "per word (default: the embedded model's tokenizer when installed)",
    )
    data.add_argument("--seed", type=int, default=0, help="seed of prompts and arrival times (default: 0)")

    load = parser.add_argument_group("load")
    load.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="Poisson arrivals per second, or inf: all at once (default: inf)",
    )
    load.add_argument(
        "--max-concurrency", type=int, default=None, help="requests in flight at most (default: no limit)"
    )
    load.add_argument(
        "--slo-ttft-ms", type=float, default=200.0, help="goodput: TTFT target in ms (default: 200)"
    )
    load.add_argument(
        "--slo-tpot-ms", type=float, default=100.0, help="goodput: TPOT target in ms (default: 100)"
    )
    load.add_argument(
        "--slo-e2e-ms", type=float, default=None, help="goodput: end-to-end target in ms (default: none)"
    )
    load.add_argument(
        "--goodput",
        nargs="+",
        default=None,
        metavar="NAME:MS",
        help="goodput's objectives as vLLM's client takes them (ttft:MS tpot:MS e2el:MS); only those "
        "named count, in place of the --slo-* targets",
    )

    baseline = parser.add_argument_group("offline baseline")
    baseline.add_argument(
        "--offline-baseline",
        action="store_true",
        help="after the run, time the model in this process on the run's shape (TTFT of one prompt of "
        "--input-len alone, TPOT of a batch of the run's mean concurrency) and print served / offline",
    )
    baseline.add_argument(
        "--offline-model",
        default=None,
        metavar="PATH",
        help="the served model's GGUF file or HF folder, run with default engine options (default: the "
        "embedded model)",
    )

    output = parser.add_argument_group("output")
    output.add_argument(
        "--result-dir", default=None, help="folder for the JSON result and PNG plots (default: bench_results)"
    )
    add_no_progress_arg(output)


def _bench_llm(args: argparse.Namespace, **defaults: Any):
    from firsttoken.engine.llm import LLM

    options = {**_BENCH_ENGINE_DEFAULTS, **defaults, **engine_kwargs(args)}
    announce_engine_start(progress_wanted(args.no_progress))
    return LLM(args.model, **options)


def run_latency(args: argparse.Namespace) -> int:
    from firsttoken.bench.latency import LatencySpec, format_json, format_report, measure_latency

    spec = LatencySpec(
        input_len=args.input_len,
        output_len=args.output_len,
        batch_size=args.batch_size,
        runs=args.runs,
        warmup_runs=args.warmup_runs,
        seed=args.seed,
    )
    runs = measure_latency(_bench_llm(args), spec, progress_wanted(args.no_progress))
    print(format_json(runs, spec) if args.json else format_report(runs, spec))
    return 0


def run_profile(args: argparse.Namespace) -> int:
    from firsttoken.bench.profile import ProfileSpec, format_json, format_report, profile_ttft

    spec = ProfileSpec(
        input_len=args.input_len,
        runs=args.runs,
        warmup_runs=args.warmup_runs,
        seed=args.seed,
        trace_path=args.trace,
    )
    result = profile_ttft(_bench_llm(args), spec, progress_wanted(args.no_progress))
    print(format_json(result, spec.input_len) if args.json else format_report(result, spec.input_len))
    if args.trace:
        print(f"trace: {args.trace}", file=sys.stderr)
    return 0


def run_compare(args: argparse.Namespace) -> int:
    from firsttoken.bench.compare import CompareSpec, compare_peers, format_report, results_payload
    from firsttoken.bench.peers import FirsttokenPeer, TransformersPeer
    from firsttoken.bench.results import result_stem, write_json

    spec = CompareSpec(
        input_lens=tuple(args.input_lens),
        output_len=args.output_len,
        runs=args.runs,
        warmup_runs=args.warmup_runs,
        seed=args.seed,
    )
    llm = _bench_llm(args, dtype="float32")
    inspection = llm.inspect()
    model_path = inspection.model_path
    peers = [FirsttokenPeer(llm), TransformersPeer.load(model_path, inspection.dtype)]
    llama_cpp = (
        None if args.no_llama_cpp else _llama_cpp_peer(model_path, max(spec.input_lens) + spec.output_len)
    )
    if llama_cpp is not None:
        peers.append(llama_cpp)
    results = compare_peers(peers, llm.tokenizer, spec, progress_wanted(args.no_progress))
    print(format_report(results, peers, spec))
    path = write_json(result_stem(args.result_dir, "compare") + ".json", results_payload(results, spec))
    print(f"saved {path}", file=sys.stderr)
    return 0


def _llama_cpp_peer(model_path: str, context_len: int):
    """llama.cpp on the same GGUF file, or None (saying why) where it cannot run."""
    from firsttoken.bench.peers import LlamaCppPeer, llama_cpp_available

    if not os.path.isfile(model_path):
        print("llama.cpp left out: it runs GGUF files, and the model is a folder", file=sys.stderr)
        return None
    if not llama_cpp_available():
        print("llama.cpp left out: `pip install llama-cpp-python` adds it", file=sys.stderr)
        return None
    return LlamaCppPeer(model_path, context_len)


def run_serve(args: argparse.Namespace) -> int:
    import asyncio
    import dataclasses

    from firsttoken.bench.datasets import DatasetSpec, build_prompts
    from firsttoken.bench.plots import write_plots
    from firsttoken.bench.results import result_stem, write_json
    from firsttoken.bench.serve_client import LoadShape, ServeTarget, run_load
    from firsttoken.bench.serve_overhead import format_overhead
    from firsttoken.bench.serve_report import format_serve_summary, serve_payload
    from firsttoken.bench.serve_stats import SLO, summarize_run
    from firsttoken.bench.server_counters import format_counters

    target = ServeTarget(args.base_url, args.endpoint, args.model, args.ignore_eos, args.timeout_s)
    shape = LoadShape(args.request_rate, args.max_concurrency, args.seed)
    dataset = DatasetSpec(
        name=args.dataset,
        num_prompts=args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        range_ratio=args.range_ratio,
        num_prefix_groups=args.prefix_groups,
        prompts_per_group=args.prompts_per_group,
        prefix_len=args.prefix_len,
        long_fraction=args.long_fraction,
        long_input_len=args.long_input_len,
        seed=args.seed,
    )
    if args.goodput is not None:
        slo = SLO.from_goodput_args(args.goodput)
    else:
        slo = SLO(args.slo_ttft_ms, args.slo_tpot_ms, args.slo_e2e_ms)
    prompts = build_prompts(dataset, _prompt_tokenizer(args.tokenizer))
    run = asyncio.run(run_load(target, shape, prompts, show_progress=progress_wanted(args.no_progress)))
    summary = summarize_run(run.records, run.duration_s, slo)
    print(format_serve_summary(summary, slo))
    if run.server_counters is not None:
        print(format_counters(run.server_counters))
    stem = result_stem(args.result_dir, f"serve-{dataset.name}")
    payload = serve_payload(target, shape, dataclasses.asdict(dataset), slo, run, summary)
    if args.offline_baseline and summary.num_completed:
        baseline = _offline_baseline(args, run)
        print("\n" + format_overhead(summary, baseline))
        payload["offline_baseline"] = dataclasses.asdict(baseline)
    saved = [write_json(stem + ".json", payload), *write_plots(run.records, stem)]
    print("saved " + " ".join(saved), file=sys.stderr)
    return 0 if summary.num_completed else 1


def _offline_baseline(args: argparse.Namespace, run: Any):
    """The engine's own figures on the run's shape, timed here once the load is over."""
    from firsttoken.bench.serve_overhead import mean_concurrency, measure_offline_baseline
    from firsttoken.engine import LLM

    decode_batch_size = max(1, round(mean_concurrency(run.records, run.duration_s)))
    return measure_offline_baseline(LLM(args.offline_model), args.input_len, decode_batch_size)


def _prompt_tokenizer(choice: str | None):
    """The tokenizer that sizes prompts: a model's, the embedded model's if installed, or none."""
    from firsttoken.models.registry import default_model_path, open_checkpoint, resolve_model_path

    if choice == "none":
        return None
    if choice is not None:
        return open_checkpoint(resolve_model_path(choice)).tokenizer
    try:
        return open_checkpoint(default_model_path()).tokenizer
    except ValueError:
        print("no tokenizer at hand: prompt lengths count one token per word", file=sys.stderr)
        return None
