"""The ISA the native kernels build for: chosen by name, refused where the CPU cannot run it,
and reported by the library that was built."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from firsttoken.config import CPU_ISAS, ModelConfig
from firsttoken.errors import InvalidInputError
from firsttoken.ops import cpu_isa, native
from tests.ops.conftest import built_kernels


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


@pytest.mark.parametrize("isa", cpu_isa.runnable_cpu_isas())
def test_a_forced_build_reports_the_isa_it_targets(isa):
    kernels = built_kernels(isa)
    if kernels is None:
        pytest.skip("no working C compiler on this machine")
    assert kernels.isa == isa


# The ISAs this CPU runs are built whole by test_a_forced_build_reports_the_isa_it_targets.
@pytest.mark.parametrize(
    "isa", [name for name in cpu_isa.ISAS if name not in ("auto", *cpu_isa.runnable_cpu_isas())]
)
def test_every_isa_compiles_here_even_one_this_cpu_cannot_run(tmp_path, monkeypatch, isa):
    compiler = shutil.which("gcc")
    if compiler is None:
        pytest.skip("no GCC on this machine (the ISA flags are GCC's)")
    monkeypatch.setenv("CC", compiler)
    try:
        native.check_sources(cpu_isa.ISAS[isa], tmp_path)
    except subprocess.CalledProcessError as error:
        pytest.fail(error.stderr.decode(errors="replace"))
