"""Tensor-parallel ranks: the process group of one engine's ranks, the processes of ranks 1..N-1,
and the pipes that carry each step to them (the executor, executor.py, puts them together).

The engine's own process is rank 0, the driver: it schedules, runs its slice of the model and
samples. Ranks 1..N-1 are processes started with torch.multiprocessing (spawn); each builds the
same worker for its slice and then runs, forever, the steps the driver sends: a step is its
`SchedulerOutput` pickled once and written to every rank's pipe. Pipes, not a collective, carry
steps: a rank waits for the next step for as long as the engine idles, which a collective's
timeout would not allow; the collectives inside a step (the all-reduces, the logits gather) do
time out. Start-up (importing torch, loading and slicing the model) is slow and uneven across
ranks, so no collective runs in it: each rank reports the KV blocks it can hold down its pipe,
the driver answers with the smallest count, and only then do the ranks form the process group.
A rank that dies breaks its connections: the driver's next collective fails at once, and the
driver then reports which rank died and how, and stops the others.
"""

from __future__ import annotations

import datetime
import logging
import multiprocessing.connection
import pickle
import signal
import socket
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.process import BaseProcess

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from firsttoken.config import DEFAULT_DISTRIBUTED_BACKENDS, EngineConfig, ParallelConfig
from firsttoken.core.batch import SchedulerOutput
from firsttoken.errors import InvalidInputError, TensorParallelError
from firsttoken.models.arch import ModelArch
from firsttoken.models.sharding import ModelShard, shard_for_rank

logger = logging.getLogger(__name__)

# What the driver writes to a rank's pipe to stop it (a step is never empty).
_STOP = b""
# How long shutdown waits for a rank to stop by itself before killing it.
_JOIN_SECONDS = 5.0


class RankGroup:
    """This process's place among the ranks: its rank, the collectives of the process group
    (the default one, so one tensor-parallel engine per process at a time), and the time they took."""

    def __init__(self, parallel: ParallelConfig, device: torch.device, rank: int) -> None:
        if dist.is_initialized():
            raise InvalidInputError(
                "tensor_parallel_size",
                "this process already runs a tensor-parallel engine; shut it down first",
            )
        self.parallel = parallel
        self.device = device
        self.rank = rank
        self.world_size = parallel.tensor_parallel_size
        # Read by the benchmark: seconds spent in all-reduces (waiting for the slowest rank
        # included), and how many.
        self.all_reduce_seconds = 0.0
        self.num_all_reduces = 0

    def shard_of(self, arch: ModelArch) -> ModelShard:
        """This rank's slice of a model of `arch`; raises InvalidInputError for a split that
        cannot be."""
        return shard_for_rank(arch, self.rank, self.world_size)

    @property
    def samples(self) -> bool:
        """Whether this rank samples: the driver gathers every rank's logits and alone samples."""
        return self.rank == 0

    def connect(self, init_method: str) -> None:
        """Form the process group with the other ranks (each calls this once it is loaded)."""
        dist.init_process_group(
            distributed_backend(self.parallel, self.device),
            init_method=init_method,
            rank=self.rank,
            world_size=self.world_size,
            timeout=datetime.timedelta(seconds=self.parallel.distributed_timeout_s),
        )

    def all_reduce(self, tensor: torch.Tensor) -> None:
        started = time.perf_counter()
        dist.all_reduce(tensor)
        self.all_reduce_seconds += time.perf_counter() - started
        self.num_all_reduces += 1

    def gather_to_driver(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        gathered = [torch.empty_like(tensor) for _ in range(self.world_size)] if self.rank == 0 else None
        dist.gather(tensor, gathered, dst=0)
        return gathered


@dataclass(frozen=True)
class RankStart:
    """What a spawned rank starts from: its rank, the rendezvous address, its pipe to the driver."""

    rank: int
    init_method: str
    connection: multiprocessing.connection.Connection

    def agree_on_num_blocks(self, num_blocks: int) -> int:
        """Report the KV blocks this rank can hold; the driver answers with the count for all."""
        self.connection.send(num_blocks)
        return self.connection.recv()


def distributed_backend(parallel: ParallelConfig, device: torch.device) -> str:
    if parallel.distributed_backend != "auto":
        return parallel.distributed_backend
    if device.type not in DEFAULT_DISTRIBUTED_BACKENDS:
        raise InvalidInputError(
            "distributed_backend", f"no default for device {device.type}: name its torch.distributed backend"
        )
    return DEFAULT_DISTRIBUTED_BACKENDS[device.type]


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank `rank`'s device: one accelerator per rank; on the CPU every rank shares the host."""
    if device.type == "cpu":
        return device
    rank_device = torch.device(device.type, rank)
    torch.get_device_module(device).set_device(rank_device)
    return rank_device


def local_init_method() -> str:
    """A TCP rendezvous on a free local port (all ranks run on this host)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"tcp://127.0.0.1:{port}"


class RankProcesses:
    """The driver's handles on ranks 1..N-1: their processes and the pipes their steps go down."""

    def __init__(self, config: EngineConfig, run_rank: Callable[[EngineConfig, RankStart], None]) -> None:
        """Start ranks 1..N-1, each running `run_rank` (a module-level function: spawn pickles it)."""
        context = mp.get_context("spawn")
        self.init_method = local_init_method()
        self.processes: list[BaseProcess] = []
        self.connections: list[multiprocessing.connection.Connection] = []
        for rank in range(1, config.parallel.tensor_parallel_size):
            driver_end, rank_end = context.Pipe()
            process = context.Process(
                target=run_rank, args=(config, RankStart(rank, self.init_method, rank_end)),
                name=f"firsttoken-rank{rank}", daemon=True,
            )
            process.start()
            rank_end.close()  # only the rank holds its end, so either one's death reads as EOF at the other
            self.processes.append(process)
            self.connections.append(driver_end)
        self.failure: TensorParallelError | None = None
        # Ranks stop with the engine, even one never shut down explicitly.
        self._finalizer = weakref.finalize(self, _stop_ranks, self.processes, self.connections)

    def agree_on_num_blocks(self, num_blocks: int) -> int:
        """The KV blocks every rank holds (ranks share block ids): the smallest count any rank
        reports, sent back to each. Waits for every rank to load; raises TensorParallelError
        for one that exits instead."""
        counts = [num_blocks]
        for rank, (process, connection) in enumerate(zip(self.processes, self.connections), start=1):
            multiprocessing.connection.wait([connection, process.sentinel])
            if not connection.poll():
                process.join()
                self.shutdown()
                raise TensorParallelError(
                    f"tensor parallel: rank {rank} {_exit_description(process.exitcode)} while starting"
                )
            counts.append(connection.recv())
        for connection in self.connections:
            connection.send(min(counts))
        return min(counts)

    def send_step(self, scheduler_output: SchedulerOutput) -> None:
        """Write the step to every rank (pickled once); raises TensorParallelError once a rank is gone."""
        if self.failure is not None:
            raise self.failure
        payload = pickle.dumps(scheduler_output, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            for connection in self.connections:
                connection.send_bytes(payload)
        except OSError as error:  # a dead rank's pipe
            raise self.fail(error) from error

    def fail(self, error: BaseException) -> TensorParallelError:
        """The error to raise for a failed step or collective: which ranks died, and how; the
        remaining ranks are stopped, and every later step raises the same error."""
        if self.failure is None:
            self.failure = TensorParallelError(
                f"tensor parallel: {self._describe_ranks()}; the engine cannot continue ({error})"
            )
            logger.error("%s", self.failure)
            for process in self.processes:  # dead or hung: not worth a polite stop
                process.kill()
            self.shutdown()
        return self.failure

    def _describe_ranks(self) -> str:
        # A rank killed mid-collective may still be exiting: give it a moment to be seen dead.
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline and all(process.exitcode is None for process in self.processes):
            time.sleep(0.05)
        dead = [
            f"rank {rank} {_exit_description(process.exitcode)}"
            for rank, process in enumerate(self.processes, start=1)
            if process.exitcode is not None
        ]
        return ", ".join(dead) if dead else "a collective failed or timed out while every rank was alive"

    def shutdown(self) -> None:
        self._finalizer()


def _exit_description(exitcode: int) -> str:
    if exitcode < 0:
        return f"was killed by {signal.Signals(-exitcode).name}"
    return f"exited with code {exitcode}"


def _stop_ranks(
    processes: list[BaseProcess], connections: list[multiprocessing.connection.Connection]
) -> None:
    for connection in connections:
        try:
            connection.send_bytes(_STOP)
        except OSError:
            pass  # already gone
        connection.close()
    deadline = time.monotonic() + _JOIN_SECONDS
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():  # hung, or stopped: SIGKILL ends even a stopped process
            process.kill()
            process.join(_JOIN_SECONDS)
    if dist.is_initialized():
        dist.destroy_process_group()


def serve_steps(start: RankStart, execute: Callable[[SchedulerOutput], object]) -> None:
    """A spawned rank's steps: run each the driver sends until told to stop or the driver is gone
    (its pipe closes); then leave the process group."""
    try:
        while True:
            payload = start.connection.recv_bytes()
            if payload == _STOP:
                break
            execute(pickle.loads(payload))
    except EOFError:
        logger.warning("rank %d: the driver is gone; stopping", start.rank)
    finally:
        dist.destroy_process_group()
