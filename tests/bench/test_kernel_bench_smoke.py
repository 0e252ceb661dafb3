"""bench/kernels.py, the script a GPU session runs (bench/gpu_run.sh), stays runnable:
its ``--smoke`` mode runs every section on CPU under the Triton interpreter, and the
summary prints its tables. GPU time is scarce; a broken script must fail here first."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TRITON_DEFAULT_FP_FUSION": "1"}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip


def test_smoke_run_writes_every_section_and_summarises(tmp_path: Path) -> None:
    out = tmp_path / "kernels.json"
    done = _run("bench/kernels.py", "--smoke", "--sweep", "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert json.loads(done.stdout) == result
    for section in ("decode", "decode_int8", "prefill", "engine", "sweep"):
        assert result[section], section
    decode = result["decode"][0]
    assert decode["triton"]["ms"] > 0 and decode["max_abs_err_vs_sdpa"] < 1e-4
    assert result["prefill"][0]["max_abs_err_vs_sdpa"] < 1e-4
    engine = result["engine"]
    assert [e["backend"] for e in engine] == ["triton", "triton+graphs", "torch"]
    assert all(e["tokens_per_s"] > 0 for e in engine)
    assert engine[1]["graph_replays"] > 0 and engine[0]["graph_replays"] == 0
    for sweep in (*result["sweep"]["decode"], *result["sweep"]["extend"]):
        assert all("ms" in v and v["max_abs_err_vs_default"] < 1e-4 for v in sweep["variants"])
        assert sweep["best"] is not None

    summary = _run("bench/kernel_summary.py", str(out))
    assert summary.returncode == 0, summary.stderr
    assert "decode (GB/s" in summary.stdout and "engine, nano-vllm recipe" in summary.stdout


def test_summary_refuses_a_missing_file(tmp_path: Path) -> None:
    done = _run("bench/kernel_summary.py", str(tmp_path / "none.json"))
    assert done.returncode == 2
    assert done.stderr.startswith("error: cannot read")
