"""The native kernels' build: csrc/ compiled with the machine's C compiler for a target ISA, once
per source, compiler flags and CPU (cached in the folder the caller names), with the limits and
structs Python shares with it written from `native_abi` into a header of the build."""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
import platform
import subprocess
import tempfile
from pathlib import Path

from firsttoken.cache_lock import building
from firsttoken.ops import native_abi
from firsttoken.ops.cpu_info import cpu_flags
from firsttoken.ops.cpu_isa import CpuIsa

_SOURCE_DIR = Path(__file__).parent / "csrc"
_SOURCES = [
    _SOURCE_DIR / name
    for name in (
        "row_kernels.c", "attention.c", "matmul.c", "quantized_matmul.c", "prefill_attention.c",
        "paged_decode_attention.c", "quantized_matmul_bf16.c", "decode_step.c", "portable_decode_step.c",
        "llama_layer.c", "w8a8_rows.c", "w8a8_matmul.c", "w8a8_projection.c", "w8a8_step.c",
        "weight_levels.c", "logits.c",
    )
]
_HEADERS = [_SOURCE_DIR / name for name in ("common.h", "isa.h", "decode_kernels.h", "llama_layer.h")]
# Written into the build folder from `native_abi` (common.h includes it).
_ABI_HEADER_NAME = "native_abi.h"
# Reassociation lets sums vectorize. Not -ffast-math: a shared library built with it sets
# flush-to-zero for the whole process when loaded (denormals would read as 0 everywhere).
# OpenMP binds, by soname, to the libgomp torch has already loaded: one thread pool. The
# target ISA's flags (`cpu_isa`) follow these.
_COMPILE_FLAGS = [
    "-O3", "-fno-math-errno", "-fno-trapping-math", "-fassociative-math", "-fno-signed-zeros",
    "-fopenmp", "-shared", "-fPIC", "-std=c11",
]


def check_sources(isa: CpuIsa, work_dir: Path) -> None:
    """Compiles the kernel sources for `isa` without generating code, in `work_dir`: a check of
    every ISA's branches against the ABI header that needs no CPU able to run them. Raises
    subprocess.CalledProcessError, the compiler's errors in its stderr."""
    (work_dir / _ABI_HEADER_NAME).write_text(native_abi.c_header())
    subprocess.run(
        [*_compiler_and_flags(isa), f"-I{work_dir}", *map(str, _SOURCES), "-fsyntax-only"],
        check=True, capture_output=True, timeout=120,
    )


def _compiler_and_flags(isa: CpuIsa) -> list[str]:
    return [os.environ.get("CC", "cc"), *_COMPILE_FLAGS, *isa.compiler_flags]


def built_library(cache_dir: Path, isa: CpuIsa) -> Path:
    """The library of these sources, flags and CPU in `cache_dir`, built there first where no
    process has built it yet."""
    sources = [path.read_bytes() for path in _SOURCES + _HEADERS]
    abi_header = native_abi.c_header()
    compiler_and_flags = _compiler_and_flags(isa)
    build_command = " ".join(compiler_and_flags).encode()
    key = hashlib.sha256(b"\0".join([*sources, abi_header.encode(), build_command, _cpu_identity()]))
    library = cache_dir / f"cpu_kernels-{key.hexdigest()[:16]}.so"
    if library.exists():
        return library
    with building(str(library.with_suffix(".lock")), f"the {isa.name} kernels"):
        if not library.exists():
            _build_library(compiler_and_flags, abi_header, library)
    return library


def _build_library(compiler_and_flags: list[str], abi_header: str, library: Path) -> None:
    cache_dir = library.parent
    cache_dir.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: a process never loads a half-written file.
    with tempfile.TemporaryDirectory(dir=cache_dir) as build_dir:
        (Path(build_dir) / _ABI_HEADER_NAME).write_text(abi_header)
        partial = Path(build_dir) / library.name
        objects = _compile_objects(compiler_and_flags, Path(build_dir))
        subprocess.run(
            [*compiler_and_flags, *map(str, objects), "-o", str(partial), "-lm"],
            check=True, capture_output=True, timeout=120,
        )
        os.replace(partial, library)


def _compile_objects(compiler_and_flags: list[str], build_dir: Path) -> list[Path]:
    """Each source compiled to an object file in `build_dir`, one compiler per core: a user's
    first start waits for this build."""

    def compile_source(source: Path) -> Path:
        target = build_dir / f"{source.stem}.o"
        subprocess.run(
            [*compiler_and_flags, f"-I{build_dir}", "-c", str(source), "-o", str(target)],
            check=True, capture_output=True, timeout=120,
        )
        return target

    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        return list(pool.map(compile_source, _SOURCES))


def _cpu_identity() -> bytes:
    """-march=native and -mtune=native code is made for CPUs with these features: key the build by them."""
    return f"{platform.machine()}|{' '.join(sorted(cpu_flags()))}".encode()
