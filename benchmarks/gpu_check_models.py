"""The device check's models and the calls every step makes on them: transformers' Llama of a
shape with seeded random weights, saved as a Hugging Face folder, the engine that loads that
folder, random prompts, and timed generates."""

from __future__ import annotations

import gc
import os
import random
import time
from typing import Any

import torch

from gpu_check_plan import Plan, Shape

from firsttoken import LLM, SamplingParams


def random_prompt(num_tokens: int, key: str, vocab_size: int) -> list[int]:
    """Token ids seeded by `key`: distinct keys give prompts no prefix cache has seen."""
    rng = random.Random(key)
    return [rng.randrange(3, vocab_size) for _ in range(num_tokens)]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_generate(llm: LLM, prompts: list[list[int]], max_tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompt_token_ids=prompts, sampling_params=params)
    return time.perf_counter() - start


def build_reference(shape: Shape, dtype: torch.dtype, device: torch.device, seed: int) -> Any:
    """transformers' Llama of this shape with seeded random weights, on `device`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        max_position_embeddings=shape.max_position_embeddings,
        rope_theta=shape.rope_theta,
        rms_norm_eps=1e-5,
        tie_word_embeddings=shape.tie_word_embeddings,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    return model.to(dtype).eval()


def save_folder(hf_model: Any, shape: Shape, folder: str) -> str:
    """The model as a Hugging Face folder, with a word-level tokenizer over its vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    hf_model.save_pretrained(folder)
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(shape.vocab_size)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(os.path.join(folder, "tokenizer.json"))
    return folder


def open_engine(
    folder: str,
    shape: Shape,
    plan: Plan,
    device: torch.device,
    cuda_graphs: bool,
    batch_invariant: bool = True,
) -> LLM:
    longest = max(max(plan.ttft_lengths), max(plan.parity_lengths) + plan.parity_new_tokens)
    kv_tokens = 3 * longest + max(plan.decode_batches) * (plan.decode_prompt_tokens + plan.decode_new_tokens)
    return LLM(
        folder,
        device=device.type,
        dtype=str(plan.dtype).removeprefix("torch."),
        cuda_graphs=cuda_graphs,
        kv_cache_memory_bytes=kv_tokens * shape.kv_bytes_per_token(plan.dtype),
        chunk_size=longest,
        max_num_batched_tokens=longest,
        max_num_seqs=max(plan.decode_batches),
        max_model_len=shape.max_position_embeddings,
        batch_invariant=batch_invariant,
    )


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
