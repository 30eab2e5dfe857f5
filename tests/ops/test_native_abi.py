"""The header generated for the kernels lays the shared structs out as ctypes does."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess

import pytest

from firsttoken.ops import native_abi

SHARED_STRUCTS = [
    native_abi.Int4Weight,
    native_abi.DecodeLayer,
    native_abi.DecodeModel,
    native_abi.DecodeBatch,
]


def _layout_program() -> str:
    """C that prints each struct's size and its fields' offsets, one struct a line."""
    lines = ["#include <stddef.h>", "#include <stdio.h>", '#include "native_abi.h"', "int main(void) {"]
    for struct in SHARED_STRUCTS:
        offsets = "".join(f", offsetof({struct.__name__}, {name})" for name, _ in struct.c_fields)
        pattern = " ".join(["%zu"] * (len(struct.c_fields) + 1))
        lines.append(f'    printf("{pattern}\\n", sizeof({struct.__name__}){offsets});')
    lines += ["    return 0;", "}"]
    return "\n".join(lines)


def test_c_and_ctypes_lay_out_the_shared_structs_alike(tmp_path):
    compiler = os.environ.get("CC", "cc")
    if shutil.which(compiler) is None:
        pytest.skip("no C compiler on this machine")
    (tmp_path / "native_abi.h").write_text(native_abi.c_header())
    (tmp_path / "layout.c").write_text(_layout_program())
    build = [compiler, "-std=c11", "-Wall", "-Wextra", "-Werror", "layout.c", "-o", "layout"]
    subprocess.run(build, cwd=tmp_path, check=True)
    printed = subprocess.run([str(tmp_path / "layout")], check=True, capture_output=True, text=True).stdout
    for struct, line in zip(SHARED_STRUCTS, printed.splitlines(), strict=True):
        expected = [ctypes.sizeof(struct)] + [getattr(struct, name).offset for name, _ in struct.c_fields]
        assert [int(number) for number in line.split()] == expected, struct.__name__
