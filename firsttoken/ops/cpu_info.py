"""What /proc/cpuinfo says about this machine's CPUs, read once per process.

The kernels' build keys on the feature flags, dtype resolution asks for bf16 instructions,
and thread counts come from the physical cores. Where the file cannot be read (not Linux),
there are no flags and no cores listed.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class CpuInfo:
    """The flags of the first CPU listed and the distinct physical cores."""

    flags: frozenset[str]
    # (physical id, core id) per core; hyperthread siblings share one.
    physical_cores: frozenset[tuple[str | None, str]]
    model_name: str = ""


@functools.cache
def _this_machine() -> CpuInfo:
    try:
        with open("/proc/cpuinfo", encoding="ascii") as cpuinfo:
            return parse_cpuinfo(cpuinfo.read())
    except OSError:
        return CpuInfo(frozenset(), frozenset())


def parse_cpuinfo(text: str) -> CpuInfo:
    """/proc/cpuinfo's text as a CpuInfo."""
    flags: frozenset[str] | None = None
    cores: set[tuple[str | None, str]] = set()
    physical_id = None
    model_name = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        # x86 names the feature list "flags", Arm "Features".
        if key in ("flags", "Features") and flags is None:
            flags = frozenset(value.split())
        elif key == "model name" and not model_name:
            model_name = value.strip()
        elif key == "physical id":
            physical_id = value.strip()
        elif key == "core id":
            cores.add((physical_id, value.strip()))
    return CpuInfo(flags or frozenset(), frozenset(cores), model_name)


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (as /proc/cpuinfo names them: avx512_bf16, amx_bf16, ...)."""
    return _this_machine().flags


def cpu_model_name() -> str:
    """The first CPU's model name ("AMD EPYC 9R14 ..."), empty where none is listed."""
    return _this_machine().model_name


def physical_core_count() -> int:
    """Cores this process may run on, counting hyperthread siblings once."""
    allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    cores = _this_machine().physical_cores
    return max(1, min(allowed, len(cores))) if cores else max(1, allowed)
