"""The ISA the native kernels build for: chosen by name, refused where the CPU cannot run it,
and reported by the library that was built."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from firsttoken.config import CPU_ISAS, ModelConfig
from firsttoken.errors import InvalidInputError
from firsttoken.ops import cpu_isa, native_build
from firsttoken.ops.cpu_info import cpu_flags
from tests.native_builds import AMX_CPU_FLAG, DEFAULT_RUN_ISAS, ISA_PARAMS, built_kernels


def test_every_configurable_isa_has_a_build_target():
    assert tuple(cpu_isa.ISAS) == CPU_ISAS


def test_an_unknown_isa_is_refused_naming_the_field():
    with pytest.raises(InvalidInputError, match="cpu_isa"):
        cpu_isa.resolve_cpu_isa("sse9")
    with pytest.raises(InvalidInputError, match="cpu_isa"):
        ModelConfig(cpu_isa="sse9")


def test_an_isa_the_cpu_lacks_is_refused_naming_the_missing_flags(monkeypatch):
    monkeypatch.setattr(cpu_isa, "cpu_flags", lambda: frozenset({"avx", "avx2", "fma"}))
    monkeypatch.setattr(cpu_isa.platform, "machine", lambda: "x86_64")
    assert cpu_isa.runnable_cpu_isas() == ["avx2"]
    with pytest.raises(InvalidInputError, match="avx512_bf16.*avx512f"):
        cpu_isa.resolve_cpu_isa("avx512_bf16")
    assert cpu_isa.resolve_cpu_isa("avx2").compiler_flags[0] == "-march=x86-64-v3"


def test_the_environment_forces_the_default_isa(monkeypatch):
    monkeypatch.setenv("FIRSTTOKEN_ISA", "avx2")
    assert ModelConfig().cpu_isa == "avx2"
    monkeypatch.delenv("FIRSTTOKEN_ISA")
    assert ModelConfig().cpu_isa == "auto"


def _what_auto_builds_here() -> str | None:
    """The name an `auto` (`-march=native`) build reports on this x86-64 CPU; None elsewhere."""
    runnable = cpu_isa.runnable_cpu_isas()
    if not runnable:
        return None
    return runnable[-1] + ("+amx" if AMX_CPU_FLAG in cpu_flags() else "")


@pytest.mark.parametrize("isa", ISA_PARAMS)
def test_a_build_reports_the_isa_it_targets(isa):
    kernels = built_kernels(isa)
    if kernels is None:
        pytest.skip("no working C compiler on this machine")
    expected = _what_auto_builds_here() if isa == "auto" else isa
    if expected is None:
        pytest.skip("auto's variant is named after x86-64 ISAs only")
    assert kernels.isa == expected


# The default run's ISAs are built whole by test_a_build_reports_the_isa_it_targets; the others
# (the widest one `auto` stands in for, those the slow tier tests) are compiled without generating code.
@pytest.mark.parametrize("isa", [name for name in cpu_isa.ISAS if name not in DEFAULT_RUN_ISAS])
def test_every_isa_compiles_here_even_one_this_cpu_cannot_run(tmp_path, monkeypatch, isa):
    compiler = shutil.which("gcc")
    if compiler is None:
        pytest.skip("no GCC on this machine (the ISA flags are GCC's)")
    monkeypatch.setenv("CC", compiler)
    try:
        native_build.check_sources(cpu_isa.ISAS[isa], tmp_path)
    except subprocess.CalledProcessError as error:
        pytest.fail(error.stderr.decode(errors="replace"))
