"""The bench and profile verbs end to end: what they print and what they write."""

from __future__ import annotations

import json
import sys

import pytest

from firsttoken.bench.stage_hooks import STAGES
from firsttoken.cli import main
from tests.bench.fake_openai_server import Script, serve_in_thread
from tests.conftest import TEST_THREADS

# Small engines of the 2-layer random-weight model (what is checked is what the verbs measure,
# print and write, not the model's words) with a fixed chunk size and thread count: no step-cost
# measurement at each engine's start.
ENGINE_FLAGS = ["--dtype", "float32", "--kv-cache-memory-bytes", str(256 << 20), "--chunk-size", "512"]
ENGINE_FLAGS += ["--no-adaptive-threads"] + (["--num-threads", str(TEST_THREADS)] if TEST_THREADS else [])
SCRIPT = Script(ttft_s=0.080, gaps_s=(0.020, 0.020, 0.020))


def test_profile_verb_prints_json_and_writes_a_chrome_trace(tmp_path, capsys, two_layer_model_path):
    trace = tmp_path / "trace.json"
    argv = [
        "profile",
        "--model",
        two_layer_model_path,
        "--input-len",
        "32",
        "--runs",
        "2",
        "--json",
        "--trace",
        str(trace),
    ]
    assert main(argv + ENGINE_FLAGS) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["input_len"] == 32 and report["num_prompt_tokens"] == 32
    assert set(report["stages_ms"]) == set(STAGES)
    assert report["ttft_ms"] > 0 and report["ttft_stats_ms"]["count"] == 2
    names = {event.get("name") for event in json.loads(trace.read_text())["traceEvents"]}
    assert {"ttft", "attention", "mlp", "lm_head", "sampling"} <= names


def test_latency_verb_reports_medians_of_the_timed_runs(capsys, monkeypatch, two_layer_model_path):
    # On a terminal: progress goes to stderr, the JSON on stdout stays whole.
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    argv = [
        "bench",
        "latency",
        "--model",
        two_layer_model_path,
        "--input-len",
        "48",
        "--output-len",
        "6",
        "--batch-size",
        "2",
    ]
    assert main(argv + ["--runs", "3", "--json"] + ENGINE_FLAGS) == 0
    shown = capsys.readouterr()
    report = json.loads(shown.out)
    assert "starting the engine" in shown.err and "batches (1 warm-up)" in shown.err
    runs, median = report["runs"], report["median"]
    assert len(runs) == 3
    for run in runs:
        assert 0 < run["ttft_s"] < run["e2e_s"]
        assert 0 < run["tpot_s"] < run["e2e_s"]
        assert run["prefill_tokens_per_s"] > 0 and run["decode_tokens_per_s"] > 0
    for name in ("ttft_s", "tpot_s", "e2e_s"):
        assert median[name] == pytest.approx(sorted(run[name] for run in runs)[1])


def test_latency_table_names_every_metric(capsys, two_layer_model_path):
    argv = [
        "bench",
        "latency",
        "--model",
        two_layer_model_path,
        "--input-len",
        "16",
        "--output-len",
        "1",
        "--runs",
        "1",
    ]
    assert main(argv + ENGINE_FLAGS) == 0
    shown = capsys.readouterr()
    table = shown.out
    assert shown.err == "", "stderr is not a terminal here: no progress"
    for label in ("TTFT (ms)", "TPOT (ms)", "end-to-end (ms)", "prefill (tokens/s)", "decode (tokens/s)"):
        assert label in table
    # One output token has no decode: those rows say so instead of inventing a number.
    assert [line.split()[-1] for line in table.splitlines() if line.strip().startswith("decode")] == ["-"]


@pytest.fixture(scope="module")
def server():
    yield from serve_in_thread(SCRIPT)


def test_serve_verb_writes_a_result_and_plots(server, tmp_path, capsys):
    argv = [
        "bench",
        "serve",
        "--base-url",
        server.base_url,
        "--dataset",
        "shared-prefix",
        "--prefix-groups",
        "2",
        "--prompts-per-group",
        "3",
        "--prefix-len",
        "20",
        "--input-len",
        "8",
        "--output-len",
        "4",
        "--request-rate",
        "50",
        "--tokenizer",
        "none",
        "--slo-ttft-ms",
        "60",
        "--result-dir",
        str(tmp_path),
        "--no-progress",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "goodput" in out and "TTFT" in out and "ITL" in out
    (result_file,) = tmp_path.glob("serve-shared-prefix-*.json")
    result = json.loads(result_file.read_text())
    summary = result["summary"]
    assert summary["num_completed"] == 6 and summary["num_failed"] == 0
    # The server sleeps 80 ms before every first token, so no TTFT is shorter however busy the
    # machine (tests/bench/test_serve_client.py checks the exact timings on a scripted clock).
    assert summary["ttft_ms"]["median"] >= 80 and summary["tpot_ms"]["median"] > 0
    assert summary["goodput"] == 0.0  # every TTFT misses the 60 ms target
    assert result["load"]["request_rate"] == 50.0 and len(result["requests"]) == 6
    assert len(list(tmp_path.glob("serve-shared-prefix-*.png"))) == 3
