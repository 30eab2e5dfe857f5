"""Start-up steps of an engine, run on scratch KV blocks before any request holds one: the
warm-up that pays the one-time costs (compiling the fused ops, the first runs of each kernel),
and the measured step-cost model. Both run their steps through the executor, so every rank
runs them alike.
"""

from __future__ import annotations

import os

from firsttoken.arithmetic import ceil_div
from firsttoken.core.batch import SampleSpec, ScheduledChunk, SchedulerOutput
from firsttoken.core.cost_model import StepCostModel
from firsttoken.sampling_params import SamplingParams
from firsttoken.worker.cost_calibration import CalibrationLimits, StepRunner, load_or_calibrate
from firsttoken.worker.worker import Worker


# The warm-up prefill's length: every prefill kernel runs at any length (the compiled fused ops,
# which start at FUSED_MIN_TOKENS rows, compile in Kernels.warm_up), and a longer one only makes
# every start slower (a 512-token warm-up was two thirds of a CPU engine's start).
WARM_UP_PREFILL_TOKENS = 32


def warm_up(steps: StepRunner, worker: Worker) -> None:
    """Compile the fused ops and run a prefill and a decode on scratch blocks, so the first
    request pays no one-time cost."""
    limits = scratch_limits(worker)
    worker.kernels.warm_up(lambda num_tokens: _run_scratch_step(steps, limits, 0, num_tokens))
    num_tokens = min(WARM_UP_PREFILL_TOKENS, limits.max_model_len - 1)
    _run_scratch_step(steps, limits, 0, num_tokens)
    _run_scratch_step(steps, limits, num_tokens, 1)


def scratch_limits(worker: Worker) -> CalibrationLimits:
    """What bounds the start-up steps: the worker's KV blocks, step and sequence sizes, vocabulary."""
    config = worker.config
    return CalibrationLimits(
        block_size=config.cache.block_size,
        num_blocks=worker.num_kv_blocks,
        max_batched_tokens=config.scheduler.max_num_batched_tokens,
        max_model_len=worker.max_model_len,
        vocab_size=worker.vocab_size,
    )


def _run_scratch_step(steps: StepRunner, limits: CalibrationLimits, start: int, num_tokens: int) -> None:
    num_blocks = ceil_div(start + num_tokens, limits.block_size)
    if num_blocks > limits.num_blocks or start + num_tokens > limits.max_model_len:
        return
    chunk = ScheduledChunk(
        req_id="warm-up",
        token_ids=[0] * num_tokens,
        start_position=start,
        block_table=list(range(num_blocks)),
        sample=SampleSpec(SamplingParams(temperature=0, max_tokens=1), 0, "warm-up"),
    )
    steps.execute(SchedulerOutput(chunks=[chunk]))


def measure_step_cost(steps: StepRunner, worker: Worker) -> StepCostModel:
    """This device's step cost, measured on scratch blocks (or cached from an earlier
    measurement that still holds)."""
    cache_file = os.path.join(worker.cache_dir, "step_costs", step_cost_cache_name(worker))
    return load_or_calibrate(steps, scratch_limits(worker), cache_file, worker.num_threads)


def step_cost_cache_name(worker: Worker) -> str:
    """The cached step cost's file name: the model, dtype, device, weights' form, kernels,
    batch invariance, threads, block size and ranks the steps run with."""
    threads = worker.num_threads if worker.device.type == "cpu" else 0
    tensor_parallel_size = worker.tensor_parallel_size
    ranks = f"-tp{tensor_parallel_size}" if tensor_parallel_size > 1 else ""
    # An int4 engine's decodes cost a fraction of a float one's, and the probe step (a
    # prefill, on float weights either way) would not tell the two apart.
    quantization = worker.config.model_config.quantization or "float"
    native_kernels = worker.kernels.native
    kernels = native_kernels.isa if native_kernels is not None else "torch"
    # Invariance changes the kernels: a bf16 decode row runs as two, a float32 projection natively.
    invariance = "inv" if worker.compute.batch_invariant else "any"
    return (
        f"{worker.checkpoint.fingerprint}-{str(worker.dtype).removeprefix('torch.')}-{worker.device.type}"
        f"-{quantization}-{kernels}-{invariance}-t{threads}-b{worker.config.cache.block_size}{ranks}.json"
    )
