"""Shared fixtures: the embedded model through firsttoken, and through transformers as the reference."""

from __future__ import annotations

import os

import pytest
import torch

from firsttoken.models.registry import default_model_path

TEST_KV_CACHE_BYTES = 512 * 1024 * 1024


@pytest.fixture(scope="session")
def model_path() -> str:
    return default_model_path()


@pytest.fixture(scope="session")
def llm(model_path):
    """A float32 engine with a fixed chunk size (no start-up calibration)."""
    from firsttoken import LLM

    return LLM(model_path, dtype="float32", kv_cache_memory_bytes=TEST_KV_CACHE_BYTES, chunk_size=512)


@pytest.fixture(scope="session")
def hf_model(model_path):
    """transformers' own GGUF loader and Llama implementation on the same file, float32."""
    from transformers import AutoModelForCausalLM

    folder, file_name = os.path.split(model_path)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file_name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def hf_tokenizer(model_path):
    from transformers import AutoTokenizer

    folder, file_name = os.path.split(model_path)
    return AutoTokenizer.from_pretrained(folder, gguf_file=file_name)
