"""The Triton kernels compile for Hopper (sm_90: the H100/H200 machines GPU sessions are
lent) without a GPU, and the builds are sound: no register spills inside loops (at most
a value parked around one), shared memory within the chip's limit, K/V tiles loaded in
16-byte vectors, bf16 extend on tensor cores (wgmma). Ampere (sm_80) builds are
``bench/kernel_compile.py``'s default too; the suite leaves them out (~25-50 s of a
core in a fresh clone, for a chip no session runs on).

The interpreter that the other kernel tests use accepts code a GPU build rejects, so
this runs ``bench/kernel_compile.py`` in a child process without ``TRITON_INTERPRET``
(this process's kernels were built for the interpreter at import). Triton's Linux
wheels carry the NVIDIA toolchain it needs (pyproject asks for triton >= 3.4, whose
``knobs`` hook it uses), so it never skips: a machine that cannot compile fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench.cuda_compile import MAX_SHARED_BYTES, _load_bytes, loop_local_ops

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "kernel_compile.py"
ALL_KERNELS = {
    "_kv_write_kernel",
    "_decode_split_kernel",
    "_decode_reduce_kernel",
    "_extend_kernel",
}


def _env(interpret: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton's own default, without its warning
    return env


def _run(args: list[str], interpret: bool) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, env=_env(interpret),
                          capture_output=True, text=True, timeout=600)  # fmt: skip


ARCHES = (90,)  # Hopper (H100/H200)


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Every quick build for every arch: one child process per arch, side by side (the
    builds are single-threaded)."""
    out = tmp_path_factory.mktemp("cuda_compile")
    procs = {}
    for arch in ARCHES:
        args = ["--arch", str(arch), "--quick", "--json", str(out / f"sm_{arch}.json")]
        procs[arch] = subprocess.Popen(
            [sys.executable, str(SCRIPT), *args], cwd=ROOT, env=_env(interpret=False),
            text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )  # fmt: skip
    builds: list[dict[str, Any]] = []
    for arch, proc in procs.items():
        output, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, output[-8000:]
        builds.extend(json.loads((out / f"sm_{arch}.json").read_text()))
    return builds


@pytest.mark.parametrize("arch", ARCHES)
def test_every_kernel_compiles_without_spills_in_loops(
    reports: list[dict[str, Any]], arch: int
) -> None:
    builds = [r for r in reports if r["arch"] == arch]
    assert {r["name"] for r in builds} == ALL_KERNELS
    for r in builds:
        assert r["problems"] == [], (r["label"], r["name"], r["problems"])
        assert r["loop_local_memory_ops"] == 0 and r["local_memory_ops"] <= 4
        assert r["shared_bytes"] <= MAX_SHARED_BYTES[arch]


@pytest.mark.parametrize("arch", ARCHES)
def test_attention_kernels_load_kv_in_16_byte_vectors(
    reports: list[dict[str, Any]], arch: int
) -> None:
    attention = [r for r in reports if r["arch"] == arch
                 and r["name"] in ("_decode_split_kernel", "_extend_kernel")]  # fmt: skip
    assert len(attention) == 2 * 6  # 4 float shapes + 2 int8 caches, each kernel
    for r in attention:
        assert r["widest_load_bytes"] == 16, (r["label"], r["name"], r["global_loads"])


def test_bf16_extend_runs_on_tensor_cores(reports: list[dict[str, Any]]) -> None:
    """wgmma (HGMMA) on Hopper."""
    extends = [r for r in reports if r["name"] == "_extend_kernel" and "bfloat16" in r["label"]]
    assert extends
    for r in extends:
        assert r["matrix_ops"].get("HGMMA", 0) > 0, (r["label"], r["matrix_ops"])


SASS = """
        /*0300*/                   IMAD.SHL.U32 R18, R152, 0x4, RZ ;   /* 0x0 */
        /*0380*/                   STL [R1], R18 ;                     /* 0x0 */
        /*1d70*/                   LDL.64 R2, [R1+0x8] ;               /* 0x0 */
        /*1d80*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ; /* 0x0 */
        /*5e10*/              @!P2 BRA 0x1d70 ;                        /* 0x0 */
        /*5e20*/                   LDL.LU R26, [R1] ;                  /* 0x0 */
        /*6ac0*/                   BRA 0x6ac0;                         /* 0x0 */
"""


def test_loop_local_ops_counts_only_spills_inside_loops() -> None:
    # The LDL at 0x1d70 is the loop's first instruction (the back branch's target);
    # the STL before and the LDL after the loop, and the self-branch at the end, are not.
    assert loop_local_ops(SASS) == 1
    assert loop_local_ops(SASS.replace("@!P2 BRA 0x1d70", "@!P2 BRA 0x5e30")) == 0


def test_refuses_to_run_under_the_interpreter() -> None:
    done = _run(["--arch", "90", "--quick"], interpret=True)
    assert done.returncode == 2
    assert done.stderr.strip() == "error: unset TRITON_INTERPRET to compile for a GPU"


@pytest.mark.parametrize(
    ("form", "width"),
    [
        ("ld.global.b16", 2),
        ("ld.global.v2.b32", 8),
        ("ld.global.v4.b32", 16),
        ("ld.global.nc.v4.b32", 16),
        ("ld.global.b64", 8),
        ("cp.async.cg.16B", 16),
        ("cp.async.ca.4B", 4),
        ("cp.async.ca.8B", 8),
    ],
)
def test_load_width_of_ptx_forms(form: str, width: int) -> None:
    assert _load_bytes(form) == width
