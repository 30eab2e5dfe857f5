"""Tensor parallelism's NCCL path: the rank group's collectives on one GPU (world size 1), and
two ranks on two GPUs giving one rank's tokens. Skipped without the GPUs they need."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from firsttoken import LLM, SamplingParams
from firsttoken.config import ParallelConfig
from firsttoken.worker.tensor_parallel import RankGroup, local_init_method
from tests.models.tiny_models import save_hf_folder, tiny_hf_model

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or not dist.is_nccl_available(), reason="needs a CUDA device and NCCL"
)


def test_an_nccl_rank_group_of_one_gpu_reduces_and_gathers():
    device = torch.device("cuda", 0)
    group = RankGroup(ParallelConfig(tensor_parallel_size=1), device, rank=0)
    group.connect(local_init_method())
    try:
        assert dist.get_backend() == "nccl"
        partial = torch.arange(4, dtype=torch.float32, device=device)
        group.all_reduce(partial)
        assert partial.tolist() == [0, 1, 2, 3] and group.num_all_reduces == 1
        (gathered,) = group.gather_to_driver(torch.ones(2, 3, device=device))
        assert torch.equal(gathered, torch.ones(2, 3, device=device))
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_gpus_give_one_gpus_greedy_tokens(tmp_path):
    folder = save_hf_folder(tiny_hf_model("llama"), str(tmp_path / "tiny-llama"))
    options = dict(
        device="cuda", dtype="float32", kv_cache_memory_bytes=64 << 20, chunk_size=32, max_num_seqs=8
    )
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = ["The capital of France is", "Once upon a time", "1, 2, 3,"]
    expected = [output.token_ids for output in LLM(folder, **options).generate(prompts, greedy)]
    two = LLM(folder, tensor_parallel_size=2, **options)
    try:
        assert [output.token_ids for output in two.generate(prompts, greedy)] == expected
    finally:
        two.shutdown()
