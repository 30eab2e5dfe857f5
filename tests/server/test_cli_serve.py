"""`firsttoken serve`: its flags, and a real server process started from the command line."""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from firsttoken.cli import build_parser
from firsttoken.config import SUBCONFIGS, flat_name
from firsttoken.server.serve_command import engine_options, server_config
from tests.http_client import HTTP


def _serve_flags() -> set[str]:
    parser = build_parser()
    serve = parser._subparsers._group_actions[0].choices["serve"]
    return {flag for action in serve._actions for flag in action.option_strings}


def test_every_engine_option_is_a_serve_flag():
    flags = _serve_flags()
    renamed = {
        "seed": "engine-seed",
        "enable_prompt_cache": "prompt-cache",
        "enable_chunked_prefill": "chunked-prefill",
    }
    for section, section_cls in SUBCONFIGS.items():
        for field in dataclasses.fields(section_cls):
            name = flat_name(section, field.name)
            assert "--" + renamed.get(name, name).replace("_", "-") in flags, name
    for flag in (
        "--host",
        "--port",
        "--api-key",
        "--served-model-name",
        "--max-queue",
        "--max-request-bytes",
        "--max-json-values",
        "--max-choices",
        "--shutdown-timeout",
        "--stream-keepalive",
        "--strict-fields",
        "--web-ui",
        "--no-web-ui",
        "--allowed-origins",
    ):
        assert flag in flags


def test_serve_flags_map_to_engine_and_server_settings():
    args = build_parser().parse_args(
        [
            "serve",
            "--dtype",
            "float32",
            "--max-model-len",
            "128",
            "--max-num-seqs",
            "4",
            "--max-queue",
            "3",
            "--api-key",
            "k",
            "--port",
            "9001",
            "--host",
            "0.0.0.0",
            "--max-request-bytes",
            "1000",
            "--shutdown-timeout",
            "2.5",
        ]
    )
    assert engine_options(args) == dict(
        dtype="float32", max_model_len=128, max_num_seqs=4, max_waiting_requests=3, prefault_kv_cache=True
    )
    lazy = build_parser().parse_args(["serve", "--no-prefault-kv-cache"])
    assert engine_options(lazy) == dict(prefault_kv_cache=False)
    config = server_config(args, "/models/SmolLM2-135M-Instruct.Q4_1.gguf")
    assert config.served_model_names == ("SmolLM2-135M-Instruct.Q4_1",)
    assert (config.host, config.port, config.api_key, config.max_request_bytes) == (
        "0.0.0.0",
        9001,
        "k",
        1000,
    )
    assert config.shutdown_timeout_s == 2.5
    assert config.stream_keepalive_s == 15
    keepalive = build_parser().parse_args(["serve", "--stream-keepalive", "5"])
    assert server_config(keepalive, "/models/x.gguf").stream_keepalive_s == 5
    assert config.web_ui
    no_page = build_parser().parse_args(["serve", "--no-web-ui"])
    assert not server_config(no_page, "/models/x.gguf").web_ui
    named = build_parser().parse_args(["serve", "--served-model-name", "a", "b"])
    assert server_config(named, "/models/x.gguf").served_model_names == ("a", "b")
    assert config.allowed_origins == ()
    cors = build_parser().parse_args(
        ["serve", "--allowed-origins", "https://a.example", "http://localhost:3000"]
    )
    assert server_config(cors, "/models/x.gguf").allowed_origins == (
        "https://a.example",
        "http://localhost:3000",
    )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


SYSTEM_PROMPT = (
    "You are the help desk of a small observatory. Answer in one short sentence, in plain words, "
    "and never invent opening hours or prices that you were not told."
)


@pytest.mark.usefixtures("model_path")  # the embedded model, loaded by the code under test
def test_serve_process_answers_and_stops_on_ctrl_c(tmp_path):
    port = _free_port()
    (tmp_path / "system.txt").write_text(SYSTEM_PROMPT)
    log = open(tmp_path / "serve.log", "w+")
    # Ctrl-C as in a terminal: a test run started in the background ignores SIGINT, and a child
    # would inherit that (shutting down cleanly but exiting 0). Handled signals reset at exec.
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        process = subprocess.Popen(
            [sys.executable, "-m", "firsttoken", "serve", "--port", str(port),
             "--served-model-name", "cli-model",
             "--dtype", "float32", "--kv-cache-memory-bytes", str(64 << 20), "--chunk-size", "64",
             "--max-model-len", "128", "--pin-system-prompt", str(tmp_path / "system.txt"),
             # One fixed thread: no step-cost measurement at start, no core taken from the others.
             "--num-threads", "1", "--no-adaptive-threads"],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
    finally:
        signal.signal(signal.SIGINT, inherited)
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert process.poll() is None and time.monotonic() < deadline, (
                tmp_path / "serve.log"
            ).read_text()
            try:
                if HTTP.get(base_url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        assert [model["id"] for model in HTTP.get(base_url + "/v1/models").json()["data"]] == ["cli-model"]
        messages = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": "When do you open?"},
        ]
        reply = HTTP.post(
            base_url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 2}, timeout=60
        )
        assert reply.status_code == 200 and reply.json()["model"] == "cli-model"
        assert reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16  # the pinned blocks
        assert [pin["id"] for pin in HTTP.get(base_url + "/v1/pins").json()["data"]] == ["system-prompt"]
        assert HTTP.get(base_url + "/").headers["content-type"] == "text/html; charset=utf-8"
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) == 130  # a clean shutdown, then the conventional Ctrl-C status
        assert "Traceback" not in (tmp_path / "serve.log").read_text()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        log.close()


def test_unreadable_system_prompt_file_is_a_clean_error(tmp_path, capsys):
    from firsttoken.cli import main

    assert main(["serve", "--pin-system-prompt", str(tmp_path / "missing.txt")]) == 2
    assert "pin_system_prompt: cannot read" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--shutdown-timeout", "nan"], "shutdown_timeout_s: must be a finite number in [0, 86400]"),
        (["--shutdown-timeout", "1e9"], "shutdown_timeout_s: must be a finite number in [0, 86400]"),
        (["--stream-keepalive", "0"], "stream_keepalive_s: must be a finite number in (0, 86400]"),
        (["--ttft-slo-ms", "inf"], "ttft_slo_ms: must be a finite number in (0, 86400000]"),
        (["--ttft-slo-ms", "1e308"], "ttft_slo_ms: must be a finite number in (0, 86400000]"),
        (["--max-queue-wait-s", "inf"], "max_queue_wait_s: must be a finite number in (0, 86400]"),
        (["--slo-policy", "refuse", "--chunk-size", "64"], "slo_policy: 'refuse' refuses a request"),
    ],
)
def test_bad_start_up_options_are_one_line_errors_before_the_model_loads(flags, message, capsys):
    from firsttoken.cli import main

    assert main(["serve", "--model", "/nonexistent.gguf", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"firsttoken: error: {message}") and err.count("\n") == 1
