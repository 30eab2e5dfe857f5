"""The header generated for the kernels lays the shared structs out as ctypes does and gives
the status codes Python's values."""

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


def _run_with_header(tmp_path, program: str) -> str:
    """What `program`, built against the generated header, prints."""
    compiler = os.environ.get("CC", "cc")
    if shutil.which(compiler) is None:
        pytest.skip("no C compiler on this machine")
    (tmp_path / "native_abi.h").write_text(native_abi.c_header())
    (tmp_path / "program.c").write_text(program)
    build = [compiler, "-std=c11", "-Wall", "-Wextra", "-Werror", "program.c", "-o", "program"]
    subprocess.run(build, cwd=tmp_path, check=True)
    return subprocess.run([str(tmp_path / "program")], check=True, capture_output=True, text=True).stdout


def test_c_and_ctypes_lay_out_the_shared_structs_alike(tmp_path):
    printed = _run_with_header(tmp_path, _layout_program())
    for struct, line in zip(SHARED_STRUCTS, printed.splitlines(), strict=True):
        expected = [ctypes.sizeof(struct)] + [getattr(struct, name).offset for name, _ in struct.c_fields]
        assert [int(number) for number in line.split()] == expected, struct.__name__


def test_c_and_python_give_the_status_codes_the_same_values(tmp_path):
    statuses = list(native_abi.Status)
    values = ", ".join(f"(int)FT_{status.name}" for status in statuses)
    program = "\n".join([
        "#include <stdio.h>",
        '#include "native_abi.h"',
        f'int main(void) {{ printf("{" ".join(["%d"] * len(statuses))}\\n", {values}); return 0; }}',
    ])
    assert [int(value) for value in _run_with_header(tmp_path, program).split()] == statuses


def test_c_parameter_text_reads_as_name_and_type_pairs():
    assert native_abi._parameters("const int64_t *block_table, float scale, const DecodeModel *model") == (
        ("block_table", "const int64_t *"),
        ("scale", "float"),
        ("model", "const DecodeModel *"),
    )
