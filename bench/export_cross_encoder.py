"""Pack a trained cross-encoder checkpoint into the weights the package ships.

Reads ``ckpt.pt`` from ``bench/train_cross_encoder.py`` (``{"state_dict", "step",
"max_len", "seed"}``) and writes ``proxy/semantic/data/cross_encoder.npz`` (matrices
int8 per row with float16 scales, vectors float32: about 23 MB) and
``cross_encoder.json``: MiniLM's BERT config, Platt calibration, threshold and the
recall-first similarity floor, all fitted on the **calib** split of the clean QQP file
only (``qqp_split``; ``fit`` trained the model, ``heldout`` stays unseen):

* Platt scaling of the shipped (int8) model's logits on the calib pairs, scored the way
  the cache scores them (query ``text_b`` against cached ``text_a``);
* ``threshold``: the lowest calibrated probability at which the calib pairs' precision
  is ``>= --target-precision`` (with at least 50 pairs above it);
* ``min_similarity``: the embedding cosine that keeps ``--min-sim-recall`` of the calib
  duplicates (rounded down to 0.01): candidates below it are not re-scored;
* ``meta.max_candidates`` (``--max-candidates``): how many of a lookup's candidates, the
  most similar first, the cross-encoder reads (its cost per lookup stays bounded).

Usage: python bench/export_cross_encoder.py --ckpt /work/ce_run/ckpt.pt
       [--out proxy/semantic/data] [--target-precision 0.97] [--min-sim-recall 0.98]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as ``python bench/<script>.py``: the repo root, for bench.*
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import numpy as np

from bench.semantic.evaluate import qqp_split, read_pairs
from bench.semantic.pair_metrics import average_precision, roc_auc
from proxy.semantic.cross_encoder import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    CrossEncoder,
    CrossEncoderConfig,
    fit_platt,
    pack_state,
)

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_QQP = ROOT.parent / "shared" / "data" / "qqp_pairs_clean_40k.jsonl"
DEFAULT_OUT = ROOT / "proxy" / "semantic" / "data"
MIN_HITS = 50


def choose_threshold(probs: np.ndarray, labels: np.ndarray, target: float) -> float:
    """Lowest probability whose pairs at or above it reach ``target`` precision."""
    order = np.argsort(-probs, kind="stable")
    hits = np.arange(1, len(order) + 1)
    precision = np.cumsum(labels[order]) / hits
    ok = np.nonzero((precision >= target) & (hits >= MIN_HITS))[0]
    if not len(ok):
        raise ValueError(f"no threshold reaches precision {target} on the calib pairs")
    return float(probs[order][ok[-1]])


def similarity_floor(sims: np.ndarray, labels: np.ndarray, recall: float) -> float:
    """Cosine keeping ``recall`` of the duplicates, rounded down to 0.01."""
    positives = np.sort(sims[labels == 1])
    value = float(np.quantile(positives, 1.0 - recall))
    return float(np.floor(value * 100) / 100)


def export(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from proxy.semantic.embedder import SentenceTransformerEmbedder, bundled_model_path

    torch.set_num_threads(args.threads)
    ckpt = torch.load(args.ckpt, map_location="cpu", weights_only=True)
    state = {k: v.float().numpy() for k, v in ckpt["state_dict"].items()}
    arrays = pack_state(state)
    bert = json.loads((bundled_model_path() / "config.json").read_text())
    bert = {k: v for k, v in bert.items() if not k.startswith("_")}
    rows = [p for p in read_pairs(args.pairs) if qqp_split(p.text_a, p.text_b) == "calib"]
    labels = np.asarray([p.label for p in rows], dtype=np.int64)
    draft = CrossEncoderConfig(bert, int(ckpt.get("max_len", 64)), 1.0, 0.0, 0.5, 0.0)
    model = CrossEncoder(draft, arrays)
    started = time.monotonic()
    logits = model.logits([(p.text_b, p.text_a) for p in rows])
    scoring_s = time.monotonic() - started
    a, b = fit_platt(logits, labels)
    probs = 1.0 / (1.0 + np.exp(-np.clip(a * logits + b, -60, 60)))
    threshold = choose_threshold(probs, labels, args.target_precision)
    embedder = SentenceTransformerEmbedder()
    va = embedder.embed_batched([p.text_a for p in rows])
    vb = embedder.embed_batched([p.text_b for p in rows])
    sims = np.sum(va * vb, axis=1)
    floor = similarity_floor(sims, labels, args.min_sim_recall)
    accepted = (probs >= threshold) & (sims >= floor)
    meta = {
        "checkpoint_step": int(ckpt.get("step", 0)),
        "seed": int(ckpt.get("seed", 0)),
        "max_candidates": args.max_candidates,
        "trained_by": "bench/train_cross_encoder.py",
        "exported_by": "bench/export_cross_encoder.py",
        "calib": {
            "pairs": len(rows),
            "positives": int(labels.sum()),
            "target_precision": args.target_precision,
            "min_sim_recall": args.min_sim_recall,
            "average_precision": round(average_precision(probs, labels), 4),
            "roc_auc": round(roc_auc(probs, labels), 4),
            "precision_at_threshold": round(float(labels[accepted].mean()), 4)
            if accepted.any() else None,
            "recall_at_threshold": round(float(labels[accepted].sum() / labels.sum()), 4),
            "scoring_ms_per_pair": round(scoring_s * 1e3 / max(1, len(rows)), 3),
        },
    }
    config = CrossEncoderConfig(bert, draft.max_len, a, b, threshold, floor, meta)
    args.out.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out / WEIGHTS_FILE, allow_pickle=False, **arrays)
    (args.out / CONFIG_FILE).write_text(json.dumps(config.to_json(), indent=1) + "\n")
    size = (args.out / WEIGHTS_FILE).stat().st_size
    return {"out": str(args.out), "weights_bytes": size, "platt_a": a, "platt_b": b,
            "threshold": threshold, "min_similarity": floor, **meta}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ckpt", type=Path, required=True)
    parser.add_argument("--pairs", type=Path, default=DEFAULT_QQP)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--target-precision", type=float, default=0.97)
    parser.add_argument("--min-sim-recall", type=float, default=0.98)
    parser.add_argument("--max-candidates", type=int, default=None,
                        help="candidates the cross-encoder reads per lookup (most similar first)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    if not args.ckpt.is_file():
        print(f"error: --ckpt: no such file: {args.ckpt}", file=sys.stderr)
        return 2
    if not 0 < args.target_precision < 1 or not 0 < args.min_sim_recall <= 1:
        print("error: --target-precision and --min-sim-recall must be in (0, 1)", file=sys.stderr)
        return 2
    print(json.dumps(export(args)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
