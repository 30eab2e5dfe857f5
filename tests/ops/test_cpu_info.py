"""Reading /proc/cpuinfo: feature flags and physical cores."""

from __future__ import annotations

from firsttoken.ops.cpu_info import parse_cpuinfo


def _processor(number: int, physical_id: int, core_id: int) -> str:
    return (
        f"processor\t: {number}\nphysical id\t: {physical_id}\ncore id\t\t: {core_id}\n"
        "vmx flags\t: ept\nflags\t\t: fpu avx512f avx512_bf16\n\n"
    )


def test_hyperthread_siblings_count_once_and_sockets_apart():
    # Two sockets of two cores, each core with two hyperthreads.
    text = "".join(
        _processor(number, physical_id, core_id)
        for number, (physical_id, core_id) in enumerate([(0, 0), (0, 1), (1, 0), (1, 1)] * 2)
    )
    info = parse_cpuinfo(text)
    assert len(info.physical_cores) == 4
    assert info.flags == {"fpu", "avx512f", "avx512_bf16"}


def test_arm_features_are_its_flags_and_it_lists_no_cores():
    info = parse_cpuinfo("processor\t: 0\nFeatures\t: fp asimd bf16\nCPU part\t: 0xd40\n")
    assert info.flags == {"fp", "asimd", "bf16"}
    assert not info.physical_cores
