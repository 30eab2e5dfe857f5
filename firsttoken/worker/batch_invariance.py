"""Whether a loaded worker may claim batch invariance: a row's logits the same bits whatever
else runs in its steps. The probes read the model, its attention backend and its kernels as
the worker built them; they never change them.
"""

from __future__ import annotations

import logging

import torch

from firsttoken.attention.backend import AttentionBackend
from firsttoken.attention.cpu_backend import CPUAttentionBackend
from firsttoken.config import EngineConfig
from firsttoken.models.llama import LlamaForCausalLM
from firsttoken.ops.kernels import Kernels
from firsttoken.ops.linear import Linear, NativeRowInvariantLinear, PackedLinear, rows_invariant

logger = logging.getLogger(__name__)

# The probe's answers in this process, by what oneDNN picks its kernels by (the weight's shape
# and type, the bias, the padding of one-row inputs, the thread count), never the weights'
# values: an engine sharing another's weights, or one of another model of the same shapes,
# starts without probing again (0.6 s of a bf16 start of the embedded model on one thread).
_ROWS_INVARIANT_BY_KERNEL_CHOICE: dict[tuple, bool] = {}


def claims_batch_invariance(
    config: EngineConfig,
    asked: bool,
    model: LlamaForCausalLM,
    backend: AttentionBackend,
    kernels: Kernels,
    dtype: torch.dtype,
    device: torch.device,
) -> bool:
    """Whether a row's logits are the same bits whatever else runs in its steps.

    What the invariance rests on: decode rows attending with the prefill kernel's
    arithmetic, each alone; row-invariant matmuls and per-row elementwise ops. Quantized
    weights are out: decode steps read them, prefills the float ones. `asked`: whether the
    worker built its model for invariance (the options', or auto's measured choice)."""
    model_config = config.model_config
    if not asked or model_config.quantization is not None:
        return False
    tensor_parallel_size = config.parallel.tensor_parallel_size
    if device.type == "cuda":
        return cuda_rows_invariant(model, backend, kernels, tensor_parallel_size)
    if tensor_parallel_size > 2:
        # Two partial sums are the same bits in either order; three or more are not.
        logger.warning(
            "batch_invariant: gloo's all-reduce may add three or more ranks' partial sums in an "
            "order that depends on the step's size; with tensor_parallel_size > 2 greedy outputs "
            "may depend on what else runs"
        )
        return False
    return (
        isinstance(backend, CPUAttentionBackend)
        and backend.decodes_as_prefill(config.cache.block_size, dtype, model.arch.head_dim)
        and matmuls_rows_invariant(model)
    )


def cuda_rows_invariant(
    model: LlamaForCausalLM, backend: AttentionBackend, kernels: Kernels, tensor_parallel_size: int
) -> bool:
    """Every row on the attention chunk kernel's tiles, every projection on the row-invariant
    Triton matmul, the norms on their one-row-per-program Triton kernels (torch's own
    reductions pick their split by the tensor's size); not across ranks."""
    if tensor_parallel_size > 1:
        logger.warning(
            "batch_invariant: NCCL's all-reduce may sum the ranks' partial products in an order "
            "that depends on the step's size; with tensor_parallel_size > 1 greedy outputs may "
            "depend on what else runs"
        )
        return False
    # Imported here: triton is needed on CUDA only.
    from firsttoken.attention.cuda_backend import CudaAttentionBackend
    from firsttoken.ops.triton_matmul import RowInvariantLinear

    on_cublas = [module for module in model.modules() if isinstance(module, Linear)]
    return (
        isinstance(backend, CudaAttentionBackend)
        and backend.rows_invariant
        and kernels.triton is not None
        and not on_cublas
        and isinstance(model.lm_head, RowInvariantLinear)
    )


def matmuls_rows_invariant(model: LlamaForCausalLM) -> bool:
    """Whether every projection gives a row the same bits at any row count: all on the native
    row-invariant matmul (float32), or all oneDNN-packed (bf16) with this CPU's kernels
    passing the probe. Where they fail it (AMX CPUs, a known property of the class, not a
    misconfiguration) the log says so at info level, with the ways to the guarantee."""
    kinds = (Linear, PackedLinear, NativeRowInvariantLinear)
    projections = [module for module in model.modules() if isinstance(module, kinds)]
    if not projections or any(isinstance(module, Linear) for module in projections):
        return False  # torch's plain matmuls pick their kernel by the row count
    packed = [module for module in projections if isinstance(module, PackedLinear)]
    if all(_probed_rows_invariant(module) for module in packed):
        return True
    logger.info(
        "batch_invariant: this CPU's oneDNN bf16 kernels give a row other bits at other batch sizes "
        "(as AMX's do), so greedy outputs may depend on what else runs; for the guarantee run float32, or "
        "start with ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 (slower prefill)"
    )
    return False


def _probed_rows_invariant(module: PackedLinear) -> bool:
    kernel_choice = (
        tuple(module.packed_weight.shape),
        module.packed_weight.dtype,
        module.bias is not None,
        module.pad_single_rows,
        torch.get_num_threads(),
    )
    if kernel_choice not in _ROWS_INVARIANT_BY_KERNEL_CHOICE:
        _ROWS_INVARIANT_BY_KERNEL_CHOICE[kernel_choice] = rows_invariant(module)
    return _ROWS_INVARIANT_BY_KERNEL_CHOICE[kernel_choice]
