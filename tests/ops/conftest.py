from __future__ import annotations

import pytest
import torch

from firsttoken.ops import native
from tests.native_builds import ISA_PARAMS, built_kernels


@pytest.fixture(scope="module", params=ISA_PARAMS)
def kernels(request) -> native.NativeKernels:
    """The kernels built for each ISA this CPU can run (an AVX-512 machine tests AVX2 too), one
    module's tests at a time; a module that needs other builds defines its own."""
    built = built_kernels(request.param)
    if built is None:
        pytest.skip("no working C compiler on this machine")
    return built


@pytest.fixture
def threads():
    """Restores torch's thread count after a test that sets it."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)
