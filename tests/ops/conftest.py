from __future__ import annotations

import pytest

from firsttoken.ops import native


@pytest.fixture(scope="session")
def native_kernels(tmp_path_factory) -> native.NativeKernels | None:
    """The compiled CPU kernels, or None on a machine without a working C compiler."""
    return native.load_native_kernels(str(tmp_path_factory.mktemp("native")))
