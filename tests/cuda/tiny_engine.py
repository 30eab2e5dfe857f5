"""A tiny random Llama and the engine's step loop without a tokenizer: enough to drive runners."""

from __future__ import annotations

import torch

from firsttoken.config import ChunkedPrefillConfig, SchedulerConfig
from firsttoken.core.hashing import root_hash
from firsttoken.core.kv_cache_manager import KVCacheManager
from firsttoken.core.scheduler import Scheduler
from firsttoken.models.arch import ModelArch
from firsttoken.models.llama import LlamaForCausalLM
from firsttoken.ops.kernels import Kernels
from firsttoken.request import Request, RequestTimestamps
from firsttoken.sampling_params import SamplingParams

TINY_ARCH = ModelArch(
    architecture="llama",
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    attention_bias=False,
)


def random_model(
    backend,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
    kernels: Kernels | None = None,
    arch: ModelArch = TINY_ARCH,
) -> LlamaForCausalLM:
    """Seeded weights large enough that greedy choices are far from ties; the reference ops
    unless `kernels` says otherwise."""
    kernels = kernels or Kernels(fused=False)
    model = LlamaForCausalLM(arch, backend, kernels, dtype, arch.max_position_embeddings)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            parameter.copy_(1 + 0.1 * noise if "norm" in name else 0.2 * noise)
    return model.to(device)


def greedy_generate(
    runner, prompts: list[list[int]], max_tokens: int, num_blocks: int, block_size: int, chunk_size: int
) -> list[list[int]]:
    """Each prompt's greedy tokens, stepping scheduler -> runner -> scheduler as EngineCore does
    (blocks before a windowed model's window given back as it advances)."""
    model = runner.model
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64),
        ChunkedPrefillConfig(chunk_size=chunk_size),
        KVCacheManager(num_blocks, block_size, True, model.kv_window, model.kv_sink_tokens),
        TINY_ARCH.max_position_embeddings,
        root_hash("tiny"),
    )
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    requests = [
        Request(
            f"req-{index}",
            prompt,
            params,
            frozenset(),
            len(prompt) + max_tokens,
            RequestTimestamps(arrival=0.0),
        )
        for index, prompt in enumerate(prompts)
    ]
    for request in requests:
        scheduler.add_request(request)
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        scheduler.update(output, runner.execute(output))
    return [request.output_token_ids for request in requests]
