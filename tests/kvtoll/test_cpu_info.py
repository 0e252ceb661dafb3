"""The CPU's flags and model name, read from a cpuinfo file."""

from __future__ import annotations

from pathlib import Path

from kvtoll.cpu_info import cpu_flags, cpu_model

X86 = (
    "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2 fma\n\n"
    "processor\t: 1\nflags\t: x\n"
)
ARM = "processor\t: 0\nFeatures\t: fp asimd bf16\nCPU part\t: 0xd40\n"


def test_the_first_cpus_flags_and_model(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text(X86)
    assert cpu_flags(info) == frozenset({"fpu", "avx2", "fma"})
    assert cpu_model(info) == "AMD EPYC"
    info.write_text(ARM)
    assert cpu_flags(info) == frozenset({"fp", "asimd", "bf16"})
    assert cpu_model(info) == "0xd40"


def test_unreadable_or_empty_cpuinfo_means_nothing_known(tmp_path: Path) -> None:
    assert cpu_flags(tmp_path / "missing") == frozenset()
    assert cpu_model(tmp_path / "missing") == ""
    (tmp_path / "empty").write_text("")
    assert cpu_flags(tmp_path / "empty") == frozenset() and cpu_model(tmp_path / "empty") == ""
