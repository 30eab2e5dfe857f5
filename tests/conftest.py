"""Shared fixtures: the embedded model through firsttoken, and through transformers as the reference."""

from __future__ import annotations

import importlib.util
import os
import tempfile

import pytest
import torch

# Converted weights, built kernels and step costs go to a cache of this run, never the user's
# (engines started by tests, and the servers they spawn, read XDG_CACHE_HOME).
_RUN_CACHE = tempfile.TemporaryDirectory(prefix="firsttoken-tests-")
os.environ["XDG_CACHE_HOME"] = _RUN_CACHE.name

# Importing firsttoken compiles kernels, which imports triton; without a GPU, tests/cuda needs
# triton's interpreter, and triton reads that choice once, when it is first imported.
if importlib.util.find_spec("triton") is not None and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from firsttoken.models.registry import default_model_path  # noqa: E402

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
