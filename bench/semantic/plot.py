"""The precision / hit-rate curve of a pair bench beside its cosine peer (matplotlib)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_curves(report: dict[str, Any], path: Path) -> None:
    """Write ``path`` (PNG): our curve, the cosine peer's, and both operating points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ours = report["per_query"]["curve"]
    peer = report["peer_gptcache_similarity_0.8"]
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    ax.plot([p["hit_rate"] for p in ours], [p["precision"] for p in ours],
            label=f"{report['verifier']} verifier", color="tab:blue")
    ax.plot([p["hit_rate"] for p in peer["curve"]], [p["precision"] for p in peer["curve"]],
            label="plain cosine (same embedder)", color="tab:orange")
    at = report["per_query"]["at_threshold"]
    if at["precision"] is not None:
        ax.scatter([at["hit_rate"]], [at["precision"]], color="tab:blue", zorder=3,
                   label=f"ours at threshold {at['threshold']:.3f}")
    if peer["precision"] is not None:
        ax.scatter([peer["hit_rate"]], [peer["precision"]], color="tab:orange", zorder=3,
                   label="cosine >= 0.8 (GPTCache default)")
    ax.set_xlabel("hit rate (hits / queries)")
    ax.set_ylabel("precision of hits")
    ax.set_ylim(0.0, 1.02)
    ax.grid(alpha=0.3)
    ax.set_title(f"{report['query_split']}: {report['queries']} queries, "
                 f"{report['pairs']} stored prompts")
    ax.legend(loc="lower left", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
