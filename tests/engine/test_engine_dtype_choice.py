"""The ``auto`` dtype: bfloat16 only where the hardware has bf16 matrix units."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.dtype_choice import cpu_flags, preferred_dtype, resolve_dtype

X86 = "processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: fpu sse2 avx2 fma {extra}\n\n"
ARM = "processor\t: 0\nFeatures\t: fp asimd {extra}\nCPU implementer\t: 0x41\n"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (X86.format(extra="avx512f avx512_bf16"), "float32"),  # bf16 dot products only
        (X86.format(extra="avx512_bf16 amx_tile amx_bf16"), "bfloat16"),
        (X86.format(extra="avx512f avx512_vnni"), "float32"),  # AVX-512 without bf16
        (X86.format(extra=""), "float32"),
        (ARM.format(extra="sve bf16"), "bfloat16"),
        (ARM.format(extra="sve"), "float32"),
        ("", "float32"),
    ],
)
def test_cpu_choice_follows_native_bf16_flags(tmp_path: Path, text: str, expected: str) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text(text)
    assert preferred_dtype("cpu", cpu_flags(info)) == expected


def test_unreadable_cpuinfo_means_no_flags(tmp_path: Path) -> None:
    assert cpu_flags(tmp_path / "missing") == frozenset()


def test_explicit_dtypes_pass_through_and_bad_ones_are_refused() -> None:
    assert resolve_dtype("float32", "cpu") == "float32"
    assert resolve_dtype("bfloat16", "cpu") == "bfloat16"
    with pytest.raises(ValueError, match="float16"):
        resolve_dtype("float16", "cpu")


def test_config_resolves_auto_once_to_this_machines_choice() -> None:
    config = EngineConfig()
    assert config.dtype == preferred_dtype("cpu") == resolve_dtype("auto", "cpu")
    assert config.dtype in ("float32", "bfloat16")
    assert EngineConfig(dtype="float32").dtype == "float32"
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(dtype="half")
