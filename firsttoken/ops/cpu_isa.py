"""The instruction sets the native CPU kernels build for, and which one a build targets.

Every kernel source compiles for any of these; where a kernel has a variant on an extension
(AVX512-BF16, AMX), the build holds it when its target has the extension. `auto` builds for
this CPU (`-march=native`); a named ISA builds for that class only, so a machine with AVX-512
can run and test the AVX2 build too. The chosen ISA is the engine option `cpu_isa`.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass

from firsttoken.config import CPU_ISAS
from firsttoken.errors import InvalidInputError
from firsttoken.ops.cpu_info import cpu_flags


@dataclass(frozen=True)
class CpuIsa:
    """A build target: the compiler flags that select it and the CPU flags it needs."""

    name: str
    compiler_flags: tuple[str, ...]
    required_cpu_flags: frozenset[str]


_X86_AVX512 = frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512dq", "avx512vl"})
ISAS = {
    "auto": CpuIsa("auto", ("-march=native",), frozenset()),
    # x86-64-v3: AVX2, FMA, F16C, BMI; no AVX-512.
    "avx2": CpuIsa("avx2", ("-march=x86-64-v3", "-mtune=native"), frozenset({"avx2", "fma"})),
    # x86-64-v4: AVX-512 F, BW, DQ, VL; no BF16 (Skylake-SP, Cascade Lake, Ice Lake, Zen 4 without it).
    "avx512": CpuIsa("avx512", ("-march=x86-64-v4", "-mtune=native"), _X86_AVX512),
    # Every CPU with AVX512-BF16 (Cooper Lake, Sapphire Rapids, Zen 4) has AVX512-VNNI too.
    "avx512_bf16": CpuIsa(
        "avx512_bf16",
        ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni", "-mtune=native"),
        _X86_AVX512 | {"avx512_bf16", "avx512_vnni"},
    ),
}


def resolve_cpu_isa(name: str) -> CpuIsa:
    """The build target `name` stands for; an ISA this CPU cannot run is an error naming it."""
    if name not in CPU_ISAS:
        raise InvalidInputError("cpu_isa", f"must be one of {CPU_ISAS}, got {name!r}")
    isa = ISAS[name]
    if isa.required_cpu_flags and platform.machine() not in ("x86_64", "AMD64"):
        raise InvalidInputError(
            "cpu_isa", f"{name} is an x86-64 instruction set; this CPU is {platform.machine()}"
        )
    missing = sorted(isa.required_cpu_flags - cpu_flags())
    if missing:
        raise InvalidInputError("cpu_isa", f"{name} needs CPU flags this CPU lacks: {', '.join(missing)}")
    return isa


def runnable_cpu_isas() -> list[str]:
    """The named ISAs this CPU can run (besides `auto`), narrowest first."""
    flags = cpu_flags()
    on_x86 = platform.machine() in ("x86_64", "AMD64")
    return [
        name for name, isa in ISAS.items() if name != "auto" and on_x86 and isa.required_cpu_flags <= flags
    ]
