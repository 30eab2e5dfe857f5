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


# Interpreted on a CPU, each test's first parametrization stands for its kernel in the default
# run, and these engine-level checks (5-16 s each there) run only in the slow tier; on a GPU
# every case runs by default.
INTERPRETED_IN_SLOW_TIER = {
    "test_a_decode_row_is_the_bits_of_the_same_token_recomputed_as_a_prefill_row",
    "test_in_chunks_the_logits_are_the_same_bits",
    "test_windowed_and_soft_capped_layers_give_the_cpu_paths_greedy_tokens",
}
_CUDA_TESTS = os.path.dirname(os.path.abspath(__file__))


@pytest.hookimpl(tryfirst=True)  # before the tiers are marked and `-m 'not slow'` deselects
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    seen_functions: set[tuple[str, str]] = set()
    for item in items:
        if not str(item.path).startswith(_CUDA_TESTS + os.sep):
            continue
        name = getattr(item, "originalname", item.name)
        function = (str(item.path), name)
        if function in seen_functions or name in INTERPRETED_IN_SLOW_TIER:
            item.add_marker(pytest.mark.slow)
        seen_functions.add(function)
