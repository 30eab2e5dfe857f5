"""The native CPU kernels the tests build: which ISAs a run tests, and each one's build in the
run's cache (tests/conftest.py points XDG_CACHE_HOME at it before this is imported)."""

from __future__ import annotations

import os

import pytest

from firsttoken.models.loaders.conversion_cache import default_cache_dir
from firsttoken.ops import native
from firsttoken.ops.cpu_info import cpu_flags
from firsttoken.ops.cpu_isa import runnable_cpu_isas

# Each ISA's kernels are built once per run, for every module, test worker and engine alike.
_RUN_NATIVE_DIR = os.path.join(default_cache_dir(), "native")
# The CPU flag that gives an `auto` build branches no named ISA has (csrc's AMX tiles).
AMX_CPU_FLAG = "amx_bf16"


def isas_under_test() -> list[str]:
    """Every ISA this CPU can run, narrowest first (an AVX-512 machine tests the AVX2 build too),
    then `auto`, the build engines use. Without AMX, `auto` (`-march=native`) takes the widest
    named ISA's branches, so it stands in for that one: a run compiles one library fewer."""
    runnable = runnable_cpu_isas()
    named = runnable if AMX_CPU_FLAG in cpu_flags() else runnable[:-1]
    return [*named, "auto"]


ISAS_UNDER_TEST = isas_under_test()
# The default run tests the narrowest named build and `auto` (the one engines here run); the named
# builds between them (AVX-512 without BF16 on a CPU with it), each one more library to compile,
# are tested in the slow tier and only compiled, without generating code, by default.
DEFAULT_RUN_ISAS = list(dict.fromkeys([ISAS_UNDER_TEST[0], ISAS_UNDER_TEST[-1]]))
ISA_PARAMS = [
    isa if isa in DEFAULT_RUN_ISAS else pytest.param(isa, marks=pytest.mark.slow) for isa in ISAS_UNDER_TEST
]


def built_kernels(isa: str = "auto") -> native.NativeKernels | None:
    """The run's kernels for `isa`; None on a machine without a working C compiler."""
    return native.load_native_kernels(_RUN_NATIVE_DIR, isa)
