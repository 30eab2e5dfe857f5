"""The CUDA path on a real GPU: the engine end to end, graphs against eager, no host sync.

Skipped without a CUDA device; the same logic runs on the CPU in the other tests/cuda files.
"""

from __future__ import annotations

import pytest
import torch

from firsttoken import LLM, SamplingParams
from firsttoken.core.batch import SampleSpec, ScheduledChunk
from firsttoken.worker.step_inputs import build_host_step
from tests.engine_state import tracked_requests
from tests.models.tiny_models import save_hf_folder, tiny_hf_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
OPTIONS = dict(dtype="float32", kv_cache_memory_bytes=64 << 20, chunk_size=32, max_num_seqs=8)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return save_hf_folder(tiny_hf_model("llama"), str(tmp_path_factory.mktemp("tiny-llama")))


def _prompts() -> list[list[int]]:
    long = list(range(100, 180))
    return [[5], list(range(10, 27)), long, long[:48] + [7, 8, 9], list(range(300, 340))]


def test_cuda_engine_gives_the_cpu_engines_greedy_tokens_with_and_without_graphs(tiny_folder):
    """Every step from graphs (prompts, chunks, prefix hits, decodes), decodes only, none."""
    expected = LLM(tiny_folder, device="cpu", **OPTIONS).generate(
        prompt_token_ids=_prompts(), sampling_params=GREEDY
    )
    for cuda_graphs, max_graph_tokens in ((True, 2048), (True, 0), (False, 2048)):
        llm = LLM(
            tiny_folder,
            device="cuda",
            cuda_graphs=cuda_graphs,
            cuda_graph_max_tokens=max_graph_tokens,
            **OPTIONS,
        )
        assert llm.core.worker.kv_caches[0].device.type == "cuda"
        assert (llm.core.worker.runner.step_graphs is not None) == (cuda_graphs and max_graph_tokens > 0)
        outputs = llm.generate(prompt_token_ids=_prompts(), sampling_params=GREEDY)
        assert [o.token_ids for o in outputs] == [o.token_ids for o in expected], (
            cuda_graphs,
            max_graph_tokens,
        )


def test_cuda_defaults_to_bfloat16_and_sizes_the_cache_from_free_memory(tiny_folder):
    llm = LLM(tiny_folder, device="cuda", gpu_memory_utilization=0.05, chunk_size=32)
    assert llm.core.worker.dtype == torch.bfloat16
    cache_bytes = sum(cache.numel() * cache.element_size() for cache in llm.core.worker.kv_caches)
    assert 0 < cache_bytes <= 0.05 * torch.cuda.get_device_properties(0).total_memory


@pytest.mark.parametrize("max_graph_tokens", [2048, 0])
def test_a_step_does_not_synchronise_before_sampling(tiny_folder, max_graph_tokens):
    """The mixed step replays a step graph, or (0) runs eagerly: Triton chunks, SDPA fresh prompt."""
    llm = LLM(tiny_folder, device="cuda", cuda_graph_max_tokens=max_graph_tokens, **OPTIONS)
    runner = llm.core.worker.runner

    def chunk(req_id: str, token_ids: list[int], start: int, block_table: list[int]) -> ScheduledChunk:
        return ScheduledChunk(req_id, token_ids, start, block_table, SampleSpec(GREEDY, 0, req_id))

    steps = [
        [chunk("a", [3], 5, [0]), chunk("b", [4], 9, [1, 2])],  # a decode graph
        [
            chunk("a", [3], 5, [0]),
            chunk("c", list(range(20)), 4, [3, 4, 5]),  # on cached context
            chunk("d", list(range(30)), 0, [6, 7]),  # fresh
        ],
    ]
    for chunks in steps:
        step = build_host_step(chunks, llm.core.config.cache.block_size)
        runner.forward_sampled_rows(step)  # first runs may compile kernels
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            hidden = runner.forward_sampled_rows(step)
            runner.model.compute_logits(hidden)
        finally:
            torch.cuda.set_sync_debug_mode("default")


PROCESSED = [
    SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=1.5),
    SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True, frequency_penalty=1.0, presence_penalty=0.5
    ),
    SamplingParams(temperature=0, max_tokens=12, logit_bias={7: 3.0, 11: -100.0}, min_tokens=12),
    SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
]


def test_cuda_engine_gives_the_cpu_engines_processed_greedy_tokens(tiny_folder):
    prompts = _prompts()[:4]
    expected = LLM(tiny_folder, device="cpu", **OPTIONS).generate(
        prompt_token_ids=prompts, sampling_params=PROCESSED
    )
    llm = LLM(tiny_folder, device="cuda", **OPTIONS)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=PROCESSED)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]
    assert tracked_requests(llm) == {}


def test_logits_processors_on_the_gpu_equal_the_cpus():
    import random

    from tests.sample.test_logits_processors import processed, random_logits, random_row

    rng = random.Random(0)
    rows = [random_row(rng, index) for index in range(16)]
    logits = random_logits(len(rows), 0)
    on_gpu = processed(logits.cuda(), rows).cpu()
    torch.testing.assert_close(on_gpu, processed(logits, rows), rtol=1e-6, atol=1e-6)
