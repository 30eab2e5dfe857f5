"""Executor: starts the engine's ranks and hands every rank each step.

With one rank, the executor is this process's worker and nothing else. With N > 1 it starts
ranks 1..N-1 in their own processes (tensor_parallel.py) while this process loads its own
slice, so the loads overlap; each rank then builds its worker the same way (`load_and_join`),
and the executor writes every step to the other ranks before running it on its own. The
workers and their runners never ask which rank they are.
"""

from __future__ import annotations

from collections.abc import Callable

from firsttoken.config import EngineConfig
from firsttoken.core.batch import ModelOutput, SchedulerOutput
from firsttoken.core.cost_model import StepCostModel
from firsttoken.errors import TensorParallelError
from firsttoken.worker.device import resolve_device
from firsttoken.worker.startup import measure_step_cost, warm_up
from firsttoken.worker.tensor_parallel import RankGroup, RankProcesses, RankStart, rank_device, serve_steps
from firsttoken.worker.worker import Worker


class Executor:
    """Owns the engine's ranks: this process's worker (rank 0, the driver, which alone samples)
    and, with tensor_parallel_size N > 1, the process group and the processes of ranks 1..N-1.
    Starts them, hands every rank each step, and stops them."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.rank_group: RankGroup | None = None
        self.rank_processes: RankProcesses | None = None
        if config.parallel.tensor_parallel_size > 1:
            self.worker = self._start_ranks()
        else:
            self.worker = Worker(config)
            self.worker.load_model()
            self.worker.allocate_kv_cache(self.worker.num_kv_blocks_that_fit())

    def _start_ranks(self) -> Worker:
        """This process's worker, once every rank has loaded its slice and joined the process
        group; a split that cannot be is refused before any other rank starts."""
        config = self.config
        self.rank_group = group = rank_group(config, 0)
        worker = Worker(config, group)  # its slice is chosen here: a split that cannot be raises
        self.rank_processes = processes = RankProcesses(config, run_rank)
        return load_and_join(worker, group, processes.agree_on_num_blocks, processes.init_method)

    def execute(self, scheduler_output: SchedulerOutput) -> ModelOutput:
        """Run the step on every rank; the driver's output."""
        if self.rank_processes is None:
            return self.worker.execute(scheduler_output)
        try:
            self.rank_processes.send_step(scheduler_output)
            return self.worker.execute(scheduler_output)
        except TensorParallelError:
            raise
        except (RuntimeError, OSError) as error:  # a collective failed or timed out
            raise self.rank_processes.fail(error) from error

    def warm_up(self) -> None:
        """Pay the one-time costs on scratch blocks. Call before any request holds a block."""
        warm_up(self, self.worker)

    def step_cost_model(self) -> StepCostModel:
        """This device's step cost, which the worker then measures its steps' threads against.
        Call before any request holds a block."""
        cost_model = measure_step_cost(self, self.worker)
        self.worker.govern_threads(cost_model)
        return cost_model

    def shutdown(self) -> None:
        """Stop the other ranks and leave the process group (nothing to do with one rank)."""
        if self.rank_processes is not None:
            self.rank_processes.shutdown()


def rank_group(config: EngineConfig, rank: int) -> RankGroup:
    """Rank `rank`'s place among the ranks, on its own device."""
    device = rank_device(resolve_device(config.model_config.device), rank)
    return RankGroup(config.parallel, device, rank)


def load_and_join(
    worker: Worker, group: RankGroup, agree_on_num_blocks: Callable[[int], int], init_method: str
) -> Worker:
    """Load the worker's slice, agree with the other ranks on the KV blocks every rank holds,
    form the process group (every rank has loaded by then), and allocate the KV cache."""
    worker.load_model()
    num_kv_blocks = agree_on_num_blocks(worker.num_kv_blocks_that_fit())
    group.connect(init_method)
    worker.allocate_kv_cache(num_kv_blocks)
    return worker


def run_rank(config: EngineConfig, start: RankStart) -> None:
    """A spawned rank's life: build its worker as the driver builds its own, then run the
    driver's steps."""
    group = rank_group(config, start.rank)
    worker = load_and_join(Worker(config, group), group, start.agree_on_num_blocks, start.init_method)
    serve_steps(start, worker.execute)
