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

from firsttoken.cli import build_parser
from firsttoken.config import SUBCONFIGS, flat_name
from firsttoken.server.cli import engine_options, server_config


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
        ]
    )
    assert engine_options(args) == dict(
        dtype="float32", max_model_len=128, max_num_seqs=4, max_waiting_requests=3
    )
    config = server_config(args, "/models/SmolLM2-135M-Instruct.Q4_1.gguf")
    assert config.served_model_names == ("SmolLM2-135M-Instruct.Q4_1",)
    assert (config.host, config.port, config.api_key, config.max_request_bytes) == (
        "0.0.0.0",
        9001,
        "k",
        1000,
    )
    named = build_parser().parse_args(["serve", "--served-model-name", "a", "b"])
    assert server_config(named, "/models/x.gguf").served_model_names == ("a", "b")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_serve_process_answers_and_stops_on_ctrl_c(tmp_path):
    port = _free_port()
    log = open(tmp_path / "serve.log", "w+")
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "firsttoken",
            "serve",
            "--port",
            str(port),
            "--served-model-name",
            "cli-model",
            "--dtype",
            "float32",
            "--kv-cache-memory-bytes",
            str(64 << 20),
            "--chunk-size",
            "64",
            "--max-model-len",
            "128",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert process.poll() is None and time.monotonic() < deadline, (
                tmp_path / "serve.log"
            ).read_text()
            try:
                if httpx.get(base_url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        assert [model["id"] for model in httpx.get(base_url + "/v1/models").json()["data"]] == ["cli-model"]
        reply = httpx.post(base_url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
        assert reply.status_code == 200 and reply.json()["model"] == "cli-model"
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) == 130  # a clean shutdown, then the conventional Ctrl-C status
        assert "Traceback" not in (tmp_path / "serve.log").read_text()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        log.close()
