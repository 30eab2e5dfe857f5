"""The CUDA path's tests: on a GPU they run there; elsewhere the Triton kernels are interpreted."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    collect_ignore_glob = ["test_*.py"]
elif not torch.cuda.is_available():
    # Before triton is first imported: its own library functions are decorated at import.
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "triton was imported before tests/cuda could select its interpreter; set TRITON_INTERPRET=1"
        )
    os.environ["TRITON_INTERPRET"] = "1"
    from tests.cuda.triton_interpreter import patch_interpreter

    patch_interpreter()


@pytest.fixture(scope="session")
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
