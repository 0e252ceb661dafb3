"""Pack a trained cross-encoder checkpoint into the weights the package ships.

Reads ``ckpt.pt`` from ``bench/train_cross_encoder.py`` (``{"state_dict", "step",
"max_len", "seed"}``) and writes ``proxy/semantic/data/cross_encoder.npz`` (matrices
int8 per row with float16 scales, vectors float32: about 23 MB) and
``cross_encoder.json``: MiniLM's BERT config, Platt calibration, threshold and the
recall-first similarity floor, all fitted on the **calib** split of the clean QQP file
only (``qqp_split``; ``fit`` trained the model, ``heldout`` stays unseen):

* Platt scaling of the shipped (int8) model's logits on the calib pairs, scored the way
  the cache scores them (query ``text_b`` against cached ``text_a``);
* ``threshold``: per query, as the cache decides: every ``text_a`` of the file stored,
  each calib ``text_b`` finds its ``--candidates`` nearest (exact cosine), those above
  the floor (at most ``--max-candidates``) are scored, the best is served when it
  reaches the threshold; the lowest threshold whose served calib queries have precision
  ``>= --target-precision`` (at least 50 of them) is chosen;
* ``min_similarity``: the embedding cosine that keeps ``--min-sim-recall`` of the calib
  duplicates (rounded down to 0.01): candidates below it are not re-scored;
* ``meta.max_candidates`` (``--max-candidates``): how many of a lookup's candidates, the
  most similar first, the cross-encoder reads (its cost per lookup stays bounded).

Usage: python bench/export_cross_encoder.py --ckpt /work/ce_run/ckpt.pt
       [--out proxy/semantic/data] [--target-precision 0.96] [--min-sim-recall 0.98]
       [--max-candidates 2] [--vectors-cache DIR]
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
        reached = float(precision[MIN_HITS - 1:].max()) if len(precision) >= MIN_HITS else None
        raise ValueError(f"no threshold reaches precision {target} on calib with >= {MIN_HITS}"
                         f" hits (best: {reached}, of {len(probs)} queries)")
    return float(probs[order][ok[-1]])


def similarity_floor(sims: np.ndarray, labels: np.ndarray, recall: float) -> float:
    """Cosine keeping ``recall`` of the duplicates, rounded down to 0.01."""
    positives = np.sort(sims[labels == 1])
    value = float(np.quantile(positives, 1.0 - recall))
    return float(np.floor(value * 100) / 100)


def nearest(a: np.ndarray, b: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices and cosines of each row of ``b``'s ``k`` nearest rows of ``a``, best first."""
    idx = np.zeros((len(b), k), dtype=np.int64)
    sim = np.zeros((len(b), k), dtype=np.float32)
    for start in range(0, len(b), 512):
        sims = b[start : start + 512] @ a.T
        top = np.argpartition(-sims, k - 1, axis=1)[:, :k]
        vals = np.take_along_axis(sims, top, axis=1)
        order = np.argsort(-vals, axis=1)
        idx[start : start + 512] = np.take_along_axis(top, order, axis=1)
        sim[start : start + 512] = np.take_along_axis(vals, order, axis=1)
    return idx, sim


def export(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from bench.semantic.evaluate import embed_cached
    from proxy.semantic.embedder import SentenceTransformerEmbedder, bundled_model_path
    from proxy.semantic.verifier import exact_repeat, rule_score

    torch.set_num_threads(args.threads)
    ckpt = torch.load(args.ckpt, map_location="cpu", weights_only=True)
    state = {k: v.float().numpy() for k, v in ckpt["state_dict"].items()}
    arrays = pack_state(state)
    bert = json.loads((bundled_model_path() / "config.json").read_text())
    bert = {k: v for k, v in bert.items() if not k.startswith("_")}
    pairs = read_pairs(args.pairs)
    calib = [i for i, p in enumerate(pairs) if qqp_split(p.text_a, p.text_b) == "calib"]
    rows = [pairs[i] for i in calib]
    labels = np.asarray([p.label for p in rows], dtype=np.int64)

    # the similarity floor, from the calib pairs' own cosines
    embedder = SentenceTransformerEmbedder()
    stored = embed_cached(embedder, [p.text_a for p in pairs], args.vectors_cache)
    asked = embed_cached(embedder, [p.text_b for p in rows], args.vectors_cache)
    own_sims = np.sum(stored[calib] * asked, axis=1)
    floor = similarity_floor(own_sims, labels, args.min_sim_recall)

    # each calib query's candidates as the cache finds them (every text_a stored)
    idx, sim = nearest(stored, asked, args.candidates)
    candidates: list[list[int]] = []
    for r in range(len(rows)):
        keep = [int(j) for j, s in zip(idx[r], sim[r], strict=True) if s >= floor]
        candidates.append(keep[: args.max_candidates] if args.max_candidates else keep)
    wanted = sorted({(r, calib[r]) for r in range(len(rows))}
                    | {(r, j) for r, js in enumerate(candidates) for j in js})
    draft = CrossEncoderConfig(bert, int(ckpt.get("max_len", 64)), 1.0, 0.0, 0.5, 0.0)
    model = CrossEncoder(draft, arrays)
    texts = [(rows[r].text_b, pairs[j].text_a) for r, j in wanted]
    started = time.monotonic()
    raw = model.logits(texts)
    scoring_s = time.monotonic() - started
    logit = {key: float(x) for key, x in zip(wanted, raw.tolist(), strict=True)}

    # Platt on the calib pairs themselves (pairwise)
    own_logits = np.asarray([logit[(r, calib[r])] for r in range(len(rows))])
    a, b = fit_platt(own_logits, labels)

    def prob(r: int, j: int) -> float:
        ruled = rule_score(rows[r].text_b, pairs[j].text_a)
        if ruled is not None:
            return ruled
        return float(1.0 / (1.0 + np.exp(-np.clip(a * logit[(r, j)] + b, -60, 60))))

    # the threshold, per query: the best candidate served when its score reaches it
    best: list[float] = []
    right: list[bool] = []
    dump: list[dict[str, Any]] = []
    for r, js in enumerate(candidates):
        if not js:
            continue
        score, j = max((prob(r, j), j) for j in js)
        best.append(score)
        right.append((j == calib[r] and rows[r].label == 1)
                     or exact_repeat(rows[r].text_b, pairs[j].text_a))
        dump.append({"score": round(score, 4), "query": rows[r].text_b,
                     "served": pairs[j].text_a, "own_pair": j == calib[r],
                     "label": rows[r].label, "right": right[-1]})
    if args.dump is not None:
        dump.sort(key=lambda d: -d["score"])
        args.dump.write_text("".join(json.dumps(d) + "\n" for d in dump))
    best_arr, right_arr = np.asarray(best), np.asarray(right, dtype=np.int64)
    probs = np.asarray([prob(r, calib[r]) for r in range(len(rows))])
    try:
        threshold = choose_threshold(best_arr, right_arr, args.target_precision)
        rule = f"per-query precision >= {args.target_precision} on calib"
    except ValueError as exc:  # QQP labels only the own pair: see the closing note
        print(f"note: {exc}; threshold from pairwise precision >= {args.pairwise_target}",
              file=sys.stderr)
        threshold = choose_threshold(probs, labels, args.pairwise_target)
        rule = f"pairwise precision >= {args.pairwise_target} on calib (per-query unreachable)"
    served = best_arr >= threshold
    meta = {
        "checkpoint_step": int(ckpt.get("step", 0)),
        "seed": int(ckpt.get("seed", 0)),
        "max_candidates": args.max_candidates,
        "trained_by": "bench/train_cross_encoder.py",
        "exported_by": "bench/export_cross_encoder.py",
        "calib": {
            "pairs": len(rows),
            "positives": int(labels.sum()),
            "stored_prompts": len(pairs),
            "candidates": args.candidates,
            "target_precision_per_query": args.target_precision,
            "threshold_rule": rule,
            "min_sim_recall": args.min_sim_recall,
            "per_query_precision": round(float(right_arr[served].mean()), 4),
            "per_query_recall": round(float(right_arr[served].sum() / labels.sum()), 4),
            "per_query_hit_rate": round(float(served.sum() / len(rows)), 4),
            "pairwise_average_precision": round(average_precision(probs, labels), 4),
            "pairwise_roc_auc": round(roc_auc(probs, labels), 4),
            "scoring_ms_per_pair": round(scoring_s * 1e3 / max(1, len(texts)), 3),
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
    parser.add_argument("--target-precision", type=float, default=0.96,
                        help="per-query precision the threshold must reach on calib")
    parser.add_argument("--min-sim-recall", type=float, default=0.98)
    parser.add_argument("--candidates", type=int, default=4,
                        help="nearest stored prompts a lookup finds (the service's default)")
    parser.add_argument("--vectors-cache", type=Path, default=None,
                        help="folder of embeddings shared with kvtoll bench semantic")
    parser.add_argument("--max-candidates", type=int, default=2,
                        help="candidates the cross-encoder reads per lookup (most similar first)")
    parser.add_argument("--pairwise-target", type=float, default=0.95,
                        help="pairwise calib precision, where the per-query target is out of reach")
    parser.add_argument("--dump", type=Path, default=None,
                        help="JSONL: each calib query's best candidate, best score first")
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
