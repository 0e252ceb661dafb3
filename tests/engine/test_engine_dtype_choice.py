"""The ``auto`` dtype: bfloat16 only where the hardware computes in bf16 natively and
oneDNN packs bf16 weights."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.dtype_choice import (
    BF16_MIN_SPEEDUP,
    native_bf16,
    preferred_dtype,
    resolve_dtype,
)
from engine.model import packed_linear
from kvtoll.cpu_info import cpu_flags

X86 = "processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: fpu sse2 avx2 fma {extra}\n\n"
ARM = "processor\t: 0\nFeatures\t: fp asimd {extra}\nCPU implementer\t: 0x41\n"


@pytest.mark.parametrize(
    ("text", "native", "matrix_units"),
    [
        (X86.format(extra="avx512f avx512_bf16"), True, False),  # bf16 dot products (Zen 4)
        (X86.format(extra="avx512_bf16 amx_tile amx_bf16"), True, True),
        (X86.format(extra="avx512f avx512_vnni"), False, False),  # AVX-512 without bf16
        (X86.format(extra=""), False, False),
        (ARM.format(extra="sve bf16"), True, True),
        (ARM.format(extra="sve"), False, False),
        ("", False, False),
    ],
)
def test_cpu_choice_follows_bf16_flags_packing_and_speed(
    tmp_path: Path, text: str, native: bool, matrix_units: bool
) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text(text)
    flags = cpu_flags(info)
    assert native_bf16("cpu", flags) is native
    fast, slow = BF16_MIN_SPEEDUP * 1.5, BF16_MIN_SPEEDUP * 0.6
    expected = "bfloat16" if native else "float32"
    assert preferred_dtype("cpu", flags, packs_bf16=True, bf16_speedup=fast) == expected
    # Unpacked bf16 linears re-lay their weights out on every call: float32 then.
    assert preferred_dtype("cpu", flags, packs_bf16=False, bf16_speedup=fast) == "float32"
    # Matrix units decide by themselves; dot products alone only if bf16 measured faster.
    slow_choice = "bfloat16" if matrix_units else "float32"
    assert preferred_dtype("cpu", flags, packs_bf16=True, bf16_speedup=slow) == slow_choice


def test_cpu_choice_probes_this_machines_packing_by_default() -> None:
    flags = frozenset({"amx_bf16"})
    expected = "bfloat16" if packed_linear.onednn_bf16_packing_works() else "float32"
    assert preferred_dtype("cpu", flags) == expected


def test_other_devices_are_float32_unless_cuda() -> None:
    assert preferred_dtype("mps", frozenset({"amx_bf16"}), packs_bf16=True) == "float32"
    assert native_bf16("mps", frozenset({"amx_bf16"})) is False


def test_explicit_dtypes_pass_through_and_bad_ones_are_refused() -> None:
    assert resolve_dtype("float32", "cpu") == "float32"
    assert resolve_dtype("bfloat16", "cpu") == "bfloat16"
    with pytest.raises(ValueError, match="float16"):
        resolve_dtype("float16", "cpu")


def test_config_resolves_auto_once_to_this_machines_choice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A fixed speed in place of the timing probe (where this CPU has only bf16 dot
    # products), so that the two resolutions cannot disagree on a busy machine.
    monkeypatch.setattr(packed_linear, "packed_bf16_speedup", lambda: 2 * BF16_MIN_SPEEDUP)
    config = EngineConfig()
    assert config.dtype == preferred_dtype("cpu") == resolve_dtype("auto", "cpu")
    assert config.dtype in ("float32", "bfloat16")
    assert EngineConfig(dtype="float32").dtype == "float32"
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(dtype="half")


def test_the_bf16_probe_is_measured_once_per_machine_and_read_back(tmp_path: Path) -> None:
    """Ten starts on one machine agree even when every fresh timing would differ."""
    from engine import dtype_probe

    timings = iter([1.5, 0.7, 1.3, 0.9, 1.2, 0.8, 1.4, 0.6, 1.1, 1.0])
    path = tmp_path / "probe.json"
    key = dtype_probe.machine_key(frozenset({"avx512_bf16"}), "Some CPU", "2.13.0")
    results = [dtype_probe.persisted_speedup(key, lambda: next(timings), path) for _ in range(10)]
    assert [r.bf16_speedup for r in results] == [1.5] * 10
    assert [r.measured_now for r in results] == [True] + [False] * 9
    flags = frozenset({"avx512f", "avx512_bf16"})
    choices = {preferred_dtype("cpu", flags, True, r.bf16_speedup) for r in results}
    assert choices == {"bfloat16"}
    other = dtype_probe.machine_key(frozenset({"avx512_bf16"}), "Other CPU", "2.13.0")
    assert dtype_probe.persisted_speedup(other, lambda: 0.5, path).measured_now  # new machine
    path.write_text("not json")
    assert dtype_probe.persisted_speedup(key, lambda: 0.9, path).bf16_speedup == 0.9


def test_concurrent_starts_share_one_probe(tmp_path: Path) -> None:
    import multiprocessing

    from tests.engine.dtype_probe_child import probe_in_child

    path = tmp_path / "probe.json"
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(4) as pool:
        speedups = pool.starmap(probe_in_child, [(str(path), i) for i in range(8)])
    assert len(set(speedups)) == 1
