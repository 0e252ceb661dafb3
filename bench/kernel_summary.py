"""Print the tables of a bench/kernels.py JSON result (the figures issue notes quote).

    python bench/kernel_summary.py results.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

PEERS = ("triton", "sdpa_gathered", "gather_plus_sdpa", "flash_attn", "flashinfer")


def _cell(row: dict[str, Any], key: str) -> str:
    if "ms" in row:
        return f"{row[key]}" if key in row else f"{row['ms']:.3f} ms"
    return "n/a" if "unavailable" in row else "error"


def decode_table(result: dict[str, Any]) -> list[str]:
    lines = ["decode (GB/s, fraction of peak for triton; peers GB/s):",
             f"{'batch':>5} {'context':>7} {'splits':>6} " + " ".join(f"{p:>16}" for p in PEERS)
             + f" {'int8 GB/s':>10} {'int8 err':>9}"]  # fmt: skip
    int8 = {(r["batch"], r["context"]): r for r in result.get("decode_int8", [])}
    for r in result.get("decode", []):
        cells = []
        for p in PEERS:
            row = r.get(p, {})
            cell = _cell(row, "gbps")
            if p == "triton" and row.get("peak_fraction") is not None:
                cell += f" ({row['peak_fraction']:.0%})"
            cells.append(f"{cell:>16}")
        q = int8.get((r["batch"], r["context"]), {})
        q_cells = f" {q.get('gbps', '-'):>10} {q.get('max_abs_err_vs_float_cache', 0):>9.2e}"
        lines.append(f"{r['batch']:>5} {r['context']:>7} {r['num_splits']:>6} "
                     + " ".join(cells) + q_cells)  # fmt: skip
    return lines


def prefill_table(result: dict[str, Any]) -> list[str]:
    lines = ["prefill over a cached prefix (TFLOP/s):",
             f"{'seqs':>4} {'prefix':>6} {'new':>5} {'triton':>8} {'sdpa':>8} {'flashinfer':>10}"]
    for r in result.get("prefill", []):
        cells = [_cell(r.get(p, {}), "tflops") for p in ("triton", "sdpa_gathered", "flashinfer")]
        lines.append(f"{r['num_seqs']:>4} {r['prefix']:>6} {r['new_tokens']:>5} "
                     f"{cells[0]:>8} {cells[1]:>8} {cells[2]:>10}")  # fmt: skip
    return lines


def engine_table(result: dict[str, Any]) -> list[str]:
    lines = ["engine, nano-vllm recipe (output tokens/s):"]
    for r in result.get("engine", []):
        if "error" in r:
            lines.append(f"  {r['backend']:>13}: error {r['error']}")
        else:
            lines.append(f"  {r['backend']:>13}: {r['tokens_per_s']} tok/s "
                         f"({r['output_tokens']} tokens, {r['requests']} requests, "
                         f"{r.get('steps', '?')} steps, {r.get('graph_replays', 0)} replayed, "
                         f"{r['seconds']} s + {r.get('build_s', '?')} s build, "
                         f"{r['model']})")  # fmt: skip
    return lines


_KEYS = ("block_n", "num_warps", "num_stages", "num_splits")


def _pick(row: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    return {k: row.get(k) for k in keys}


def sweep_table(result: dict[str, Any]) -> list[str]:
    sweep = result.get("sweep")
    if not sweep:
        return []
    lines = ["sweep: default vs best variant"]
    decode_keys, extend_keys = _KEYS, ("block_m", *_KEYS[:3])
    for r in sweep["decode"]:
        default, top = r["variants"][0], r["best"] or {}
        lines.append(f"  decode b={r['batch']} ctx={r['context']}: default "
                     f"{default.get('gbps', 'error')} GB/s, best {top.get('gbps')} GB/s "
                     f"{_pick(top, decode_keys)}")  # fmt: skip
    for r in sweep["extend"]:
        default, top = r["variants"][0], r["best"] or {}
        lines.append(f"  extend s={r['num_seqs']} prefix={r['prefix']} new={r['new_tokens']}: "
                     f"default {default.get('tflops', 'error')} TFLOP/s, best "
                     f"{top.get('tflops')} {_pick(top, extend_keys)}")  # fmt: skip
    return lines


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: kernel_summary.py RESULT.json", file=sys.stderr)
        return 2
    try:
        result = json.loads(Path(argv[0]).read_text())
    except (OSError, ValueError) as exc:
        print(f"error: cannot read {argv[0]}: {exc}", file=sys.stderr)
        return 2
    print(f"{result.get('device')}  peak {result.get('peak_gbps')} GB/s, copy "
          f"{result.get('copy_gbps')} GB/s  {result.get('versions')}  {result.get('shape')}")
    for table in (decode_table, prefill_table, engine_table, sweep_table):
        print("\n".join(table(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
