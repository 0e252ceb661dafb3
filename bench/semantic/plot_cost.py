"""Lookup cost of the semantic cache before and after a change, from the figures'
JSON: p50/p99 of each lookup stage at 100k entries (``bench/semantic_scale.py``) and
semantic hits per second over HTTP (``bench/semantic_http.py``), one bar pair each.

Usage: python -m bench.semantic.plot_cost --scale BEFORE.json AFTER.json
       --http BEFORE.json AFTER.json [--labels before after] --out FILE.png
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

STAGES = ("embed", "search", "verify", "total")


def plot_cost(scale: Sequence[dict[str, Any]], http: Sequence[dict[str, Any]],
              labels: Sequence[str], path: Path) -> None:  # fmt: skip
    """Write ``path`` (PNG): stage p99s side by side, then hits/s side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.2), dpi=120,
                                      gridspec_kw={"width_ratios": [3, 1]})  # fmt: skip
    width = 0.8 / len(scale)
    for n, (report, label) in enumerate(zip(scale, labels, strict=True)):
        xs = [s + n * width for s in range(len(STAGES))]
        p99 = [report["lookup_ms"][s]["p99"] for s in STAGES]
        left.bar(xs, p99, width, label=f"{label} (load {report.get('load_average_1m')})")
        for x, value in zip(xs, p99, strict=True):
            left.text(x, value, f"{value:.1f}", ha="center", va="bottom", fontsize=7)
    left.axhline(15.0, color="grey", linestyle="--", linewidth=1, label="goal: total p99 15 ms")
    left.set_xticks([s + 0.4 - width / 2 for s in range(len(STAGES))], STAGES)
    left.set_ylabel("lookup p99 at 100k entries (ms)")
    left.legend(fontsize=7)
    rates = [r["semantic"]["semantic_hits_per_s"] for r in http]
    right.bar(list(labels), rates, color=["tab:blue", "tab:orange", "tab:green"][: len(rates)])
    for x, value in enumerate(rates):
        right.text(x, value, f"{value:.0f}", ha="center", va="bottom", fontsize=8)
    right.axhline(300.0, color="grey", linestyle="--", linewidth=1)
    right.set_ylabel("semantic hits/s over HTTP (goal 300)")
    right.tick_params(axis="x", labelsize=7, labelrotation=15)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scale", type=Path, nargs="+", required=True)
    parser.add_argument("--http", type=Path, nargs="+", required=True)
    parser.add_argument("--labels", nargs="+", default=["before", "after"])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if not len(args.scale) == len(args.http) == len(args.labels):
        parser.error("--scale, --http and --labels need one entry per run")
    scale = [json.loads(p.read_text()) for p in args.scale]
    http = [json.loads(p.read_text()) for p in args.http]
    plot_cost(scale, http, args.labels, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
