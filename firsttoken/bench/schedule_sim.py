"""A served workload on the real scheduler with a step-cost model as its device.

Time is simulated: requests arrive at the serving client's Poisson offsets, every step takes
what the cost model predicts for its tokens and attention pairs, and each request's first
token comes at the end of the step that samples it. Chunk policies compare here in
milliseconds of CPU where a served sweep takes minutes, and the comparison is deterministic,
so a test can hold `auto` to the best fixed chunk on every machine's cost model.

What it leaves out: the cost model's error (the online correction stays at 1), the scheduler's
and the server's own time between steps, KV cache pressure (every request fits: no preemption),
draft tokens and queue-wait limits.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace

from firsttoken.bench.serve_client import arrival_offsets
from firsttoken.config import ChunkedPrefillConfig, SchedulerConfig
from firsttoken.core.batch import ModelOutput
from firsttoken.core.cost_model import StepCostModel, StepTimeTracker
from firsttoken.core.hashing import root_hash
from firsttoken.core.kv_cache_manager import KVCacheManager
from firsttoken.core.scheduler import Scheduler
from firsttoken.logprobs import SampledToken
from firsttoken.request import Request, RequestTimestamps
from firsttoken.sampling_params import SamplingParams

# Token ids of the simulated prompts are drawn below this, and the sampled token is this + 1:
# no prompt meets another's blocks by chance, and no request ends on an end-of-sequence token.
_VOCAB_SIZE = 32_000
_EOS = 0


@dataclass(frozen=True)
class SimulatedLoad:
    """Random prompts of `input_len` tokens (a `long_fraction` of them `long_input_len`),
    `output_len` out, arriving at `rate` per second (inf: all at once), as the serving client
    sends them."""

    input_len: int
    output_len: int
    num_requests: int
    rate: float
    seed: int = 0
    long_fraction: float = 0.0
    long_input_len: int = 2048


@dataclass(frozen=True)
class SimulatedArrival:
    """One request: when it arrives (seconds from the run's start) and its sizes in tokens."""

    arrival_s: float
    input_len: int
    output_len: int


def poisson_arrivals(load: SimulatedLoad) -> list[SimulatedArrival]:
    """The requests of `load`, at the serving client's arrival offsets for its rate and seed."""
    rng = random.Random(load.seed)
    offsets = arrival_offsets(load.num_requests, load.rate, load.seed)
    return [
        SimulatedArrival(
            offset,
            load.long_input_len if rng.random() < load.long_fraction else load.input_len,
            load.output_len,
        )
        for offset in offsets
    ]


@dataclass(frozen=True)
class SimulatedRecord:
    """One request's prompt size and times, in seconds from its arrival."""

    num_prompt_tokens: int
    ttft_s: float
    latency_s: float
    num_output_tokens: int

    @property
    def tpot_s(self) -> float | None:
        if self.num_output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.num_output_tokens - 1)


@dataclass(frozen=True)
class SimulatedRun:
    """What a client would have measured, and how many steps the engine ran."""

    records: list[SimulatedRecord]
    duration_s: float
    num_steps: int

    @property
    def request_throughput(self) -> float:
        return len(self.records) / self.duration_s if self.duration_s > 0 else math.inf

    def ttft_ms(self, percentile: float) -> float:
        return 1000 * _percentile([record.ttft_s for record in self.records], percentile)

    def tpot_ms(self, percentile: float) -> float:
        tpots = [record.tpot_s for record in self.records if record.tpot_s is not None]
        return 1000 * _percentile(tpots, percentile) if tpots else 0.0


def _percentile(values: Sequence[float], percentile: float) -> float:
    """Linear interpolation between order statistics (numpy's default, as the client reports)."""
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    position = percentile / 100 * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


class SimulatedClock:
    """The scheduler's clock: the simulated time, moved only by arrivals and steps."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def simulate(
    cost_model: StepCostModel,
    arrivals: Sequence[SimulatedArrival],
    chunked_prefill: ChunkedPrefillConfig,
    scheduler_config: SchedulerConfig | None = None,
    block_size: int = 16,
    seed: int = 0,
) -> SimulatedRun:
    """Serve `arrivals` (in arrival order) on a scheduler whose steps take what `cost_model`
    predicts; `seed` draws the prompts' token ids."""
    scheduler_config = scheduler_config or SchedulerConfig()
    clock = SimulatedClock()
    max_total_tokens = max(arrival.input_len + arrival.output_len for arrival in arrivals)
    # Room for every request at once: the comparison is of schedules, not of cache pressure.
    num_blocks = sum(math.ceil((a.input_len + a.output_len) / block_size) for a in arrivals) + 1
    kv_manager = KVCacheManager(num_blocks, block_size, enable_caching=True)
    scheduler = Scheduler(
        scheduler_config,
        chunked_prefill,
        kv_manager,
        max_model_len=max_total_tokens,
        hash_root=root_hash("simulated"),
        step_times=StepTimeTracker(cost_model),
        clock=clock,
    )
    requests = _requests(arrivals, random.Random(seed))
    next_arrival = 0
    num_steps = 0
    while next_arrival < len(requests) or scheduler.has_unfinished_requests():
        while next_arrival < len(requests) and arrivals[next_arrival].arrival_s <= clock.now:
            scheduler.add_request(requests[next_arrival])
            next_arrival += 1
        output = scheduler.schedule()
        if output.is_empty:
            if next_arrival == len(requests):
                raise RuntimeError("the scheduler holds requests but schedules none")
            clock.now = arrivals[next_arrival].arrival_s
            continue
        clock.now += cost_model.predict_chunks(output.chunks)
        sampled = {chunk.req_id: SampledToken(_EOS + 1) for chunk in output.chunks if chunk.sample}
        scheduler.update(output, ModelOutput(sampled))
        num_steps += 1
    duration_s = clock.now - arrivals[0].arrival_s
    return SimulatedRun([_record_of(request) for request in requests], duration_s, num_steps)


def _requests(arrivals: Sequence[SimulatedArrival], rng: random.Random) -> list[Request]:
    return [
        Request(
            req_id=f"simulated-{index}",
            prompt_token_ids=[rng.randrange(_EOS + 2, _VOCAB_SIZE) for _ in range(arrival.input_len)],
            sampling_params=SamplingParams(temperature=0, max_tokens=arrival.output_len, ignore_eos=True),
            eos_token_ids=frozenset({_EOS}),
            max_total_tokens=arrival.input_len + arrival.output_len,
            timestamps=RequestTimestamps(arrival=arrival.arrival_s, tokenized=arrival.arrival_s),
        )
        for index, arrival in enumerate(arrivals)
    ]


def _record_of(request: Request) -> SimulatedRecord:
    stamps = request.timestamps
    assert stamps.first_token is not None and stamps.finished is not None  # every request ran
    return SimulatedRecord(
        num_prompt_tokens=request.num_prompt_tokens,
        ttft_s=stamps.first_token - stamps.arrival,
        latency_s=stamps.finished - stamps.arrival,
        num_output_tokens=request.num_output_tokens,
    )


def saturated_rate(
    cost_model: StepCostModel, load: SimulatedLoad, scheduler_config: SchedulerConfig | None = None
) -> float:
    """Requests of `load`'s sizes per second this device completes when they all wait at once,
    served in whole prefills: the capacity a sweep's rates are fractions of."""
    scheduler_config = scheduler_config or SchedulerConfig()
    burst = replace(load, num_requests=2 * scheduler_config.max_num_seqs, rate=math.inf)
    whole = ChunkedPrefillConfig(chunk_size=scheduler_config.max_num_batched_tokens)
    return simulate(cost_model, poisson_arrivals(burst), whole, scheduler_config).request_throughput


@dataclass(frozen=True)
class PolicyFigures:
    """What the client would report of one chunk setting at one sweep point, over its seeds."""

    label: str
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float
    tpot_p99_ms: float


@dataclass(frozen=True)
class SweepPoint:
    """Every setting at one workload and rate."""

    load: SimulatedLoad
    capacity_fraction: float
    figures: list[PolicyFigures]

    def of(self, label: str) -> PolicyFigures:
        return next(figures for figures in self.figures if figures.label == label)


def sweep_chunk_policies(
    cost_model: StepCostModel,
    loads: Sequence[SimulatedLoad],
    capacity_fractions: Sequence[float],
    settings: dict[str, ChunkedPrefillConfig],
    seeds: Sequence[int] = (1, 2, 3),
) -> list[SweepPoint]:
    """Each setting on each load at each fraction of the device's capacity for that load, the
    records of `seeds` (each its own arrivals and prompts) pooled."""
    points = []
    for load in loads:
        capacity = saturated_rate(cost_model, load)
        for fraction in capacity_fractions:
            figures = []
            for label, setting in settings.items():
                records: list[SimulatedRecord] = []
                for seed in seeds:
                    arrivals = poisson_arrivals(replace(load, rate=fraction * capacity, seed=seed))
                    records += simulate(cost_model, arrivals, setting, seed=seed).records
                run = SimulatedRun(records, duration_s=0.0, num_steps=0)
                figures.append(
                    PolicyFigures(label, run.ttft_ms(50), run.ttft_ms(99), run.tpot_ms(50), run.tpot_ms(99))
                )
            points.append(SweepPoint(replace(load, rate=fraction * capacity), fraction, figures))
    return points
