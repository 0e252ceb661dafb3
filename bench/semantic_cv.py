"""Out-of-fold precision/recall curve of the verifier over the QQP ``fit`` split.

The calib split is small (about 80 hits at the default threshold), so a verifier change
is judged here instead: the ``fit`` pairs are cut into ``--folds`` folds; for each fold
the verifier is trained (exactly as ``semantic_train.py`` trains it: the other folds'
pairs, their mined negatives and the hard cases of the ``train`` split) and the fold's
queries are replayed as the cache sees them (top-4 of every fit and calib prompt by
cosine, the best verifier score wins). The pooled (score, outcome) pairs give, at each
recall, the precision under the own-pair rule (``strict``), excluding the queries that
are another pair's stored prompt (``excluding_forced``) and over own-pair hits only
(``own_pair``). The held-out split is never read.

Usage: .venv/bin/python bench/semantic_cv.py [--embeddings-cache PATH.npz] [--folds 5]
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as ``python bench/<script>.py``: the repo root, for bench.*
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from bench import semantic_train as st
from bench.semantic.evaluate import qqp_split
from proxy.semantic.embedder import EmbedderSpec, SentenceTransformerEmbedder
from proxy.semantic.verifier import LogisticVerifier

RECALLS = (0.03, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4)


def replay_outcomes(
    verifier: LogisticVerifier, rows: list[dict[str, Any]], a: np.ndarray, b: np.ndarray,
    queries: list[int], prompts: list[int],
) -> list[tuple[float, str, int]]:  # fmt: skip
    """(best score, outcome, query) per query with a candidate; outcome as in
    :mod:`bench.semantic.pair_metrics` (correct | own_label_0 | other_entry)."""
    idx, sims = st.top_candidates(b[queries], a[prompts], st.NUM_CANDIDATES)
    out: list[tuple[float, str, int]] = []
    for qi, i in enumerate(queries):
        cands = [(prompts[c], s) for c, s in zip(idx[qi].tolist(), sims[qi].tolist(), strict=True)
                 if s >= st.MIN_SIMILARITY]  # fmt: skip
        if not cands:
            continue
        scores = verifier.score_many(rows[i]["text_b"], [(rows[j]["text_a"], s) for j, s in cands])
        best = int(np.argmax(scores))
        j = cands[best][0]
        if rows[j]["text_a"] != rows[i]["text_a"]:
            outcome = "other_entry"
        else:
            outcome = "correct" if rows[i]["label"] == 1 else "own_label_0"
        out.append((scores[best], outcome, i))
    return out


def curve(
    scored: list[tuple[float, str, int]], rows: list[dict[str, Any]], queries: list[int],
    prompts: list[int],
) -> dict[str, dict[str, float]]:  # fmt: skip
    """Precision views at the lowest threshold reaching each recall in :data:`RECALLS`."""
    stored = {rows[j]["text_a"] for j in prompts}
    positives = sum(rows[i]["label"] for i in queries)
    targets = list(RECALLS)
    out: dict[str, dict[str, float]] = {}
    correct = own = kept_hits = kept_correct = 0
    for hits, (score, outcome, i) in enumerate(sorted(scored, key=lambda s: -s[0]), start=1):
        correct += outcome == "correct"
        own += outcome != "other_entry"
        forced = rows[i]["text_b"] in stored and rows[i]["text_b"] != rows[i]["text_a"]
        kept_hits += not forced
        kept_correct += outcome == "correct" and not forced
        while targets and correct / positives >= targets[0]:
            out[str(targets.pop(0))] = {
                "threshold": round(score, 4), "strict": round(correct / hits, 4),
                "excluding_forced": round(kept_correct / max(1, kept_hits), 4),
                "own_pair": round(correct / max(1, own), 4),
            }  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pairs", type=Path, default=st.DEFAULT_QQP)
    parser.add_argument("--embeddings-cache", type=Path, default=None)
    parser.add_argument("--folds", type=int, default=5)
    parser.add_argument("--hard-weight", type=float, default=5.0)
    args = parser.parse_args()

    rows = st.load_jsonl(args.pairs)
    a, b = st.embed_qqp(rows, args.embeddings_cache)
    splits = [qqp_split(r["text_a"], r["text_b"]) for r in rows]
    fit = [i for i, s in enumerate(splits) if s == "fit"]
    prompts = fit + [i for i, s in enumerate(splits) if s == "calib"]
    embedder = SentenceTransformerEmbedder(EmbedderSpec())
    hard = st.hard_examples(embedder, "train", args.hard_weight)
    scored: list[tuple[float, str, int]] = []
    for fold in range(args.folds):
        train = [i for n, i in enumerate(fit) if n % args.folds != fold]
        held = [i for n, i in enumerate(fit) if n % args.folds == fold]
        weights = st.fit_weights(st.build_examples(rows, a, b, train, st.NUM_CANDIDATES) + hard,
                                 embedder.name)  # fmt: skip
        scored += replay_outcomes(LogisticVerifier(weights), rows, a, b, held, prompts)
    report = {"folds": args.folds, "fit_queries": len(fit), "prompts": len(prompts),
              "at_recall": curve(scored, rows, fit, prompts)}  # fmt: skip
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
