"""The trials of `firsttoken tune` on real servers: one `firsttoken serve` process per setting,
the workload sent at each rate by the serving benchmark's client. The prompts and arrival times
follow from the rate: every setting probed at a rate gets the same requests, and a setting's
probes at different rates get fresh prompts (one must not hit the prefix cache another filled)."""

from __future__ import annotations

import asyncio
import zlib
from dataclasses import dataclass
from typing import Any

from firsttoken.bench.datasets import DatasetSpec, PromptTokenizer, build_prompts
from firsttoken.bench.serve_client import LoadShape, ServeTarget, run_load
from firsttoken.bench.server_process import LOOPBACK, ServerProcess
from firsttoken.bench.tune import Probe, Setting, probe_from_records


@dataclass(frozen=True)
class Workload:
    """The requests a probe sends: random prompts of `input_len` tokens, `output_len` out."""

    input_len: int
    output_len: int
    num_prompts: int
    seed: int = 0


class ServedTrials:
    """A trial function for `tune`: serves `workload` at a rate on a server with a setting's
    options (over `base_options`), keeping that server up while the same setting is probed.
    Servers listen on `host` and `port` (else a free port each): one at a time, each stopped
    before the next starts, so they can share it."""

    def __init__(
        self,
        model: str | None,
        base_options: dict[str, Any],
        workload: Workload,
        ttft_objective_ms: float,
        tokenizer: PromptTokenizer | None,
        host: str = LOOPBACK,
        port: int | None = None,
        show_progress: bool = False,
    ) -> None:
        self.model = model
        self.base_options = base_options
        self.workload = workload
        self.ttft_objective_ms = ttft_objective_ms
        self.tokenizer = tokenizer
        self.host = host
        self.port = port
        self.show_progress = show_progress
        self._setting: Setting | None = None
        self._server: ServerProcess | None = None

    def __call__(self, setting: Setting, rate: float) -> Probe:
        server = self._server_for(setting)
        seed = self.workload.seed + zlib.crc32(repr(rate).encode())
        spec = DatasetSpec(
            num_prompts=self.workload.num_prompts,
            input_len=self.workload.input_len,
            output_len=self.workload.output_len,
            seed=seed,
        )
        prompts = build_prompts(spec, self.tokenizer)
        target = ServeTarget(server.base_url, ignore_eos=True)
        shape = LoadShape(rate, seed=seed)
        run = asyncio.run(run_load(target, shape, prompts, show_progress=self.show_progress))
        return probe_from_records(rate, run.records, self.ttft_objective_ms)

    def close(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None

    def _server_for(self, setting: Setting) -> ServerProcess:
        if self._server is not None and self._setting == setting:
            return self._server
        self.close()
        self._setting = setting
        options = {**self.base_options, **setting.as_dict}
        self._server = ServerProcess(self.model, options, host=self.host, port=self.port).__enter__()
        return self._server
