"""bench/cpu_gemm.py on a small shape: both products timed, the comparison reported."""

from __future__ import annotations

import subprocess
import sys

import pytest

import bench.cpu_gemm as cpu_gemm
from engine.kernels.cpu_gemm import gemm_here
from engine.kernels.cpu_gemm_avx2 import avx2_int8_gemm_here


def test_measure_times_both_and_counts_differences(monkeypatch: pytest.MonkeyPatch) -> None:
    if gemm_here() is None:
        pytest.skip("no native bfloat16 kernel here")
    monkeypatch.setattr(cpu_gemm, "SHAPES", {"tiny": (64, 96, 2)})
    case = cpu_gemm.measure([3], threads=2, runs=1)["tiny_3"]
    assert case["native_us"] > 0 and case["onednn_us"] > 0 and case["speedup"] > 0
    assert case["outputs"] == 3 * 96
    assert 0 <= case["outputs_differing_from_onednn"] <= case["outputs"] // 10


def test_avx2_section_times_both_and_reports_the_error(monkeypatch: pytest.MonkeyPatch) -> None:
    if avx2_int8_gemm_here() is None:
        pytest.skip("no AVX2 int8 kernel here")
    monkeypatch.setattr(cpu_gemm, "SHAPES", {"tiny": (64, 96, 2)})
    case = cpu_gemm.measure_avx2([3], threads=2, runs=1)["tiny_3"]
    assert case["avx2_int8_us"] > 0 and case["onednn_f32_us"] > 0 and case["speedup"] > 0
    assert 0 < case["relative_error_vs_f32"] < 0.01  # int8 weights: close, not exact


def test_bad_rows_are_one_error_line_and_exit_2() -> None:
    proc = subprocess.run([sys.executable, "-m", "bench.cpu_gemm", "--rows", "0,x"],
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 2
    assert "error: --rows must list positive row counts" in proc.stderr
