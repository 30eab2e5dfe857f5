"""`firsttoken tune`: the rate search, the choice of setting, the written config, on a fake server
(a model of one whose P99 TTFT grows past its capacity), and config files read back by the flags."""

from __future__ import annotations

import json
import math

import pytest

from firsttoken.bench import tune_served
from firsttoken.bench.serve_stats import RequestRecord
from firsttoken.bench.server_process import ServerProcess
from firsttoken.bench.tune import (
    Probe,
    Setting,
    best_result,
    least_sending_s,
    parse_search,
    probe_from_records,
    search_rate,
    tune,
)
from firsttoken.bench.tune_progress import TuneProgress
from firsttoken.cli import build_parser, main
from firsttoken.engine_args import engine_flags, engine_kwargs
from firsttoken.errors import InvalidInputError

OBJECTIVE_MS = 500.0


def fake_probe(rate: float, capacity: float, num_sent: int = 100) -> Probe:
    """A server that keeps the objective up to `capacity` req/s and falls behind beyond it."""
    p99 = 300.0 * (1 + max(0.0, rate - capacity) * 20)
    num_within = num_sent if rate <= capacity else num_sent // 2
    return Probe(rate, num_sent, num_within, p50_ttft_ms=200.0, p99_ttft_ms=p99)


def test_the_rate_doubles_while_kept_then_bisects_toward_the_capacity():
    probes = search_rate(lambda rate: fake_probe(rate, capacity=1.3), start_rate=0.25, max_probes=7)
    rates = [probe.rate for probe in probes]
    assert rates[:4] == [0.25, 0.5, 1.0, 2.0]
    kept = max(probe.rate for probe in probes if probe.keeps())
    lost = min(probe.rate for probe in probes if not probe.keeps())
    assert kept <= 1.3 < lost
    assert lost / kept < 1.2  # three bisections of [1, 2] on a log scale


def test_a_start_rate_already_lost_halves_until_kept():
    probes = search_rate(lambda rate: fake_probe(rate, capacity=0.1), start_rate=1.0, max_probes=5)
    assert [probe.rate for probe in probes][:4] == [1.0, 0.5, 0.25, 0.125]
    assert any(probe.keeps() for probe in probes)


def test_the_best_setting_keeps_the_highest_rate_and_a_failed_one_is_reported():
    capacities = {"small": 0.4, "large": 1.6, "broken": None}
    settings = [Setting((("chunk_size", name),)) for name in capacities]

    def trial(setting: Setting, rate: float) -> Probe:
        capacity = capacities[setting.as_dict["chunk_size"]]
        if capacity is None:
            raise RuntimeError("the server exited (1): no such kernel")
        return fake_probe(rate, capacity)

    seen: list[tuple[str, float]] = []
    def record(setting: Setting, probe: Probe) -> None:
        seen.append((setting.label, probe.rate))

    results = tune(settings, trial, 0.25, 6, on_probe=record)
    by_label = {result.setting.label: result for result in results}
    assert by_label["chunk_size=broken"].error == "the server exited (1): no such kernel"
    assert by_label["chunk_size=broken"].best_rate is None
    assert by_label["chunk_size=small"].best_rate <= 0.4 < by_label["chunk_size=large"].best_rate <= 1.6
    assert best_result(results).setting.label == "chunk_size=large"
    assert len(seen) == 12  # every probe of the two that started was reported


def test_a_tie_goes_to_the_lower_p99():
    slow, fast = Setting((("max_num_seqs", 8),)), Setting((("max_num_seqs", 32),))

    def trial(setting: Setting, rate: float) -> Probe:
        probe = fake_probe(rate, capacity=1.0)
        if setting == slow:
            return Probe(probe.rate, probe.num_sent, probe.num_within, 200.0, probe.p99_ttft_ms + 50)
        return probe

    assert best_result(tune([slow, fast], trial, 0.25, 5)).setting == fast
    assert best_result(tune([slow], lambda setting, rate: fake_probe(rate, 0.0), 0.25, 3)) is None


def _record(ttft_s: float | None) -> RequestRecord:
    if ttft_s is None:
        return RequestRecord(start_s=0.0, num_prompt_tokens=10, error="HTTP 429: ttft_slo_unattainable")
    return RequestRecord(start_s=0.0, num_prompt_tokens=10, success=True, ttft_s=ttft_s, latency_s=ttft_s)


def test_a_refused_or_failed_request_counts_as_a_miss():
    kept = probe_from_records(1.0, [_record(0.1)] * 99 + [_record(None)], OBJECTIVE_MS)
    assert kept.keeps() and kept.num_within == 99 and kept.p99_ttft_ms == pytest.approx(100.0)
    lost = probe_from_records(1.0, [_record(0.1)] * 98 + [_record(None)] * 2, OBJECTIVE_MS)
    assert not lost.keeps() and math.isinf(lost.p99_ttft_ms)
    late = probe_from_records(1.0, [_record(0.1)] * 90 + [_record(0.9)] * 10, OBJECTIVE_MS)
    assert not late.keeps() and late.p99_ttft_ms == pytest.approx(900.0)
    assert late.p50_ttft_ms == pytest.approx(100.0)


def test_the_search_grid_is_every_combination_with_typed_values():
    settings = parse_search(["chunk_size=auto,256", "quantization=none,int4", "enable_prompt_cache=false"])
    assert [setting.as_dict for setting in settings] == [
        {"chunk_size": "auto", "quantization": None, "enable_prompt_cache": False},
        {"chunk_size": "auto", "quantization": "int4", "enable_prompt_cache": False},
        {"chunk_size": 256, "quantization": None, "enable_prompt_cache": False},
        {"chunk_size": 256, "quantization": "int4", "enable_prompt_cache": False},
    ]
    assert settings[0].label == "chunk_size=auto quantization=none enable_prompt_cache=False"
    for bad in ("chunk_size", "chunk_size=", "=3"):
        with pytest.raises(InvalidInputError, match="search: .*give NAME=VALUE"):
            parse_search([bad])


def test_engine_flags_are_read_back_as_the_same_options():
    options = {
        "chunk_size": "auto",
        "max_num_seqs": 16,
        "quantization": "int4",
        "enable_prompt_cache": False,
        "ttft_slo_ms": 250.0,
        "seed": 3,
        "speculative_config": {"method": "ngram", "num_speculative_tokens": 4},
    }
    args = build_parser().parse_args(["serve", *engine_flags({**options, "max_waiting_requests": None})])
    assert engine_kwargs(args) == options


def test_a_config_file_sets_engine_options_and_flags_given_beside_it_win(tmp_path):
    config = tmp_path / "tuned.json"
    config.write_text(json.dumps({"chunk_size": 256, "max_num_seqs": 8}))
    args = build_parser().parse_args(["serve", "--config", str(config), "--max-num-seqs", "32"])
    assert engine_kwargs(args) == {"chunk_size": 256, "max_num_seqs": 32}
    config.write_text("[1, 2]")
    with pytest.raises(InvalidInputError, match="config: .* must hold one JSON object"):
        engine_kwargs(build_parser().parse_args(["serve", "--config", str(config)]))
    with pytest.raises(InvalidInputError, match="config: cannot read"):
        engine_kwargs(build_parser().parse_args(["serve", "--config", str(tmp_path / "missing.json")]))


class FakeServedTrials:
    """Stands in for the servers: int4 keeps twice the rate of the float weights."""

    started: list[FakeServedTrials] = []

    def __init__(
        self, model, base_options, workload, ttft_objective_ms, tokenizer, host, port, show_progress
    ) -> None:
        self.base_options = base_options
        self.listen = (host, port)
        self.closed = False
        FakeServedTrials.started.append(self)

    def __call__(self, setting: Setting, rate: float) -> Probe:
        options = {**self.base_options, **setting.as_dict}
        return fake_probe(rate, capacity=1.0 if options.get("quantization") == "int4" else 0.5)

    def close(self) -> None:
        self.closed = True


def test_tune_writes_the_best_setting_as_a_config_serve_reads(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tune_served, "ServedTrials", FakeServedTrials)
    output = tmp_path / "tuned.json"
    code = main([
        "tune", "--ttft-p99-ms", "500", "--search", "quantization=none,int4", "--max-probes", "4",
        "--max-num-seqs", "16", "--output", str(output), "--result-dir", str(tmp_path / "results"),
    ])  # fmt: skip
    assert code == 0
    written = json.loads(output.read_text())
    assert written == {"max_num_seqs": 16, "quantization": "int4"}
    shown = capsys.readouterr()
    assert "tune: 2 settings x up to 4 rates x 30 prompts (at most 240 requests" in shown.err
    assert "[setting 1/2] quantization=none: starting a server\n" in shown.err
    assert "[setting 2/2] quantization=int4: starting a server; " in shown.err
    assert "[quantization=int4] rate 4/4, " in shown.err
    assert "best: quantization=int4 at" in shown.out
    assert "quantization=none" in shown.out and "highest rate kept" in shown.out
    assert len(list((tmp_path / "results").glob("tune*_p99_by_rate.png"))) == 1
    assert engine_kwargs(build_parser().parse_args(["serve", "--config", str(output)])) == written


def test_tune_refuses_an_unknown_option_before_starting_any_server(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tune_served, "ServedTrials", FakeServedTrials)
    output = tmp_path / "tuned.json"
    code = main(["tune", "--ttft-p99-ms", "500", "--search", "chunk_sise=64", "--output", str(output)])
    assert code == 2
    assert "unknown engine option(s): chunk_sise" in capsys.readouterr().err
    assert not output.exists()


def test_the_estimate_counts_arrivals_and_the_pace_gives_the_time_left(capsys):
    clock = iter([0.0, 600.0])  # the run's start, the second setting's start
    progress = TuneProgress(3, max_probes=3, ttft_objective_ms=500.0, clock=lambda: next(clock))
    progress.plan(num_prompts=11, output_len=64, start_rate=0.5)
    progress.setting_started(1, Setting((("max_num_seqs", 8),)))
    lines = capsys.readouterr().err.splitlines()
    # 10 gaps at 0.5, 1 and 2 req/s: 20 + 10 + 5 s a setting, 105 s for three.
    assert "sends for at least 0.6 min (11 arrivals at 0.5 req/s span 20 s" in lines[1]
    assert "at least 1.8 min in all" in lines[1]
    assert lines[2] == (
        "[setting 2/3] max_num_seqs=8: starting a server; 10.0 min so far, about 20.0 min left at this pace"
    )
    assert least_sending_s(11, 0.5, 3) == 35.0


def test_tune_starts_its_servers_on_the_host_and_port_given(tmp_path, monkeypatch):
    monkeypatch.setattr(tune_served, "ServedTrials", FakeServedTrials)
    monkeypatch.setattr(FakeServedTrials, "started", [])
    code = main([
        "tune", "--ttft-p99-ms", "500", "--search", "quantization=none,int4", "--max-probes", "2",
        "--host", "0.0.0.0", "--port", "8123", "--output", str(tmp_path / "tuned.json"),
        "--result-dir", str(tmp_path),
    ])  # fmt: skip
    assert code == 0
    assert [trials.listen for trials in FakeServedTrials.started] == [("0.0.0.0", 8123)]


@pytest.mark.parametrize("port", ["0", "65536", "http"])
def test_a_port_out_of_range_is_refused_naming_the_option(port, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["tune", "--ttft-p99-ms", "500", "--port", port])
    assert exit_info.value.code == 2
    assert "argument --port:" in capsys.readouterr().err


def test_a_server_on_every_interface_is_reached_over_the_loopback_on_its_port():
    every_interface, ipv6_loopback = (
        ServerProcess(None, {}, host="0.0.0.0", port=8123), ServerProcess(None, {}, host="::1", port=8124)
    )
    command = every_interface.command
    assert command[command.index("--host"):][:4] == ["--host", "0.0.0.0", "--port", "8123"]
    assert every_interface.base_url == "http://127.0.0.1:8123"
    assert ipv6_loopback.base_url == "http://[::1]:8124"
    every_interface.stop()  # never started: this closes their log files
    ipv6_loopback.stop()


@pytest.mark.server
def test_a_server_that_cannot_start_is_reported_with_its_last_words():
    with pytest.raises(RuntimeError, match=r"the server exited \(2\): .*max_num_seqs: must be >= 1"):
        with ServerProcess(None, {"max_num_seqs": 0}):
            pass
