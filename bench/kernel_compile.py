"""Compile the Triton kernels for CUDA GPUs here, without one, and print what they cost.

For each target (default sm_90, Hopper, and sm_80, Ampere) every kernel is built through
its real launcher at the engine's head layouts (SmolLM2-135M: 9/3 heads, head_dim 64;
Llama-3-8B: 32/8, head_dim 128), in bf16, fp16 and fp32, block sizes 8/16/32, and with
int8 caches (see bench.cuda_compile). Per build it prints registers, stack
frame, local-memory instructions (spills), shared memory, the widest global load and
the matrix instructions; ``--json`` writes the rows. Exit status 1 when a build spills
inside a loop, spills more than a few values around its loops, or needs more shared
memory than its target has: a GPU would run it slowly or not at all.

    python bench/kernel_compile.py [--arch 90 --arch 80] [--quick] [--json out.json]

Run without TRITON_INTERPRET (the interpreter's kernels cannot be compiled).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

if __package__ in (None, ""):  # run as ``python bench/<script>.py``: the repo root, for bench.*
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

QUICK_LABELS = ("smollm2 bfloat16", "smollm2 float32", "llama3-8b bfloat16", "llama3-8b float32")
INT8_LABELS = ("smollm2 bfloat16", "llama3-8b bfloat16")
# Local-memory ops tolerated outside loops: ptxas at its register cap may park a value
# before the tile loop and reload it after (2 ops per program, nothing per tile).
MAX_LOCAL_OPS_OUTSIDE_LOOPS = 4


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arch", type=int, action="append", help="compute capability (repeatable)")
    p.add_argument("--quick", action="store_true",
                   help=f"only {', '.join(QUICK_LABELS)} (and their int8 caches)")  # fmt: skip
    p.add_argument("--json", type=Path, help="write every report here")
    return p.parse_args(argv)


def problems(report: object, arch: int) -> list[str]:
    """What would make this build slow or fail on the GPU."""
    from bench.cuda_compile import MAX_SHARED_BYTES, KernelReport

    assert isinstance(report, KernelReport)
    found = []
    if report.loop_local_memory_ops:
        found.append(f"{report.loop_local_memory_ops} local-memory ops inside loops "
                     f"({report.stack_bytes} B stack)")  # fmt: skip
    elif report.local_memory_ops > MAX_LOCAL_OPS_OUTSIDE_LOOPS:
        found.append(f"{report.local_memory_ops} local-memory ops ({report.stack_bytes} B stack)")
    limit = MAX_SHARED_BYTES.get(arch)
    if limit is not None and report.shared_bytes > limit:
        found.append(f"shared memory {report.shared_bytes} B > {limit} B")
    return found


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("error: unset TRITON_INTERPRET to compile for a GPU", file=sys.stderr)
        return 2
    from bench.cuda_compile import compile_reports, default_shapes, unavailable_reason

    reason = unavailable_reason()
    if reason:
        print(f"error: cannot compile for CUDA here: {reason}", file=sys.stderr)
        return 2
    shapes = default_shapes()
    if args.quick:
        shapes = [s for s in shapes if s.label in QUICK_LABELS]
    rows, bad = [], 0
    print(f"{'target':7} {'launch':34} {'kernel':24} {'warps':>5} {'stages':>6} {'regs':>4} "
          f"{'stack':>5} {'LDL/STL':>7} {'in loop':>7} {'smem':>7} {'load B':>6} "
          "matrix")  # fmt: skip
    start = time.perf_counter()
    for arch in args.arch or [90, 80]:
        for r in compile_reports(arch, shapes, INT8_LABELS):
            issues = problems(r, arch)
            bad += bool(issues)
            matrix = ",".join(f"{k}x{v}" for k, v in sorted(r.matrix_ops.items())) or "-"
            flag = f"  <- {'; '.join(issues)}" if issues else ""
            print(f"sm_{arch:<4} {r.label:34} {r.name:24} {r.num_warps:5} {r.num_stages:6} "
                  f"{r.registers:4} {r.stack_bytes:5} {r.local_memory_ops:7} "
                  f"{r.loop_local_memory_ops:7} {r.shared_bytes:7} "
                  f"{r.widest_load_bytes:6} {matrix}{flag}")  # fmt: skip
            rows.append({"arch": arch, **asdict(r), "widest_load_bytes": r.widest_load_bytes,
                         "problems": issues})  # fmt: skip
    print(f"{len(rows)} builds in {time.perf_counter() - start:.0f} s; {bad} with problems")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1, default=str))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
