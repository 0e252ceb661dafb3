"""Train the semantic-cache verifier and write proxy/semantic/data/verifier_weights.json.

Data (none of it ships; only the learned weights do):
* QQP pairs (../shared/data/qqp_pairs_12k.jsonl): split by a hash of the pair into
  ``heldout`` (20 %, never used here) and ``train``; ``train`` is split again into
  ``fit`` (85 %, the logistic regression) and ``calib`` (15 %, threshold choice).
* Mined negatives: for each ``fit`` query, its nearest ``fit`` prompts other than its
  own pair (what the cache will actually compare it with), label 0.
* Hand-written hard cases (bench/semantic/hard_cases.jsonl), ``split == train``
  only, weighted ``--hard-weight``.
The threshold is the lowest one whose precision on the ``calib`` pairs (the verifier's
decision on labelled pairs) is >= ``--target-precision``. The strict replay figure
(the cache's lookup of each ``calib`` query against every train prompt, a hit correct
only on its own pair with label 1) is reported beside it.

To judge a change to the features or the training, compare the out-of-fold curves of
``bench/semantic_cv.py`` (the calib split alone is too small for that).

Usage: .venv/bin/python bench/semantic_train.py [--embeddings-cache PATH.npz]
Prints one JSON object (counts, calibration figures, held-out hard-case results).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as ``python bench/<script>.py``: the repo root, for bench.*
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import numpy.typing as npt

from bench.semantic.evaluate import qqp_split
from proxy.semantic.embedder import EmbedderSpec, SentenceTransformerEmbedder
from proxy.semantic.features import FEATURE_NAMES
from proxy.semantic.verifier import LogisticVerifier, VerifierWeights

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_QQP = ROOT.parent / "shared" / "data" / "qqp_pairs_12k.jsonl"
HARD_CASES = ROOT / "bench" / "semantic" / "hard_cases.jsonl"
WEIGHTS_OUT = ROOT / "proxy" / "semantic" / "data" / "verifier_weights.json"
NUM_CANDIDATES = 4
MIN_SIMILARITY = 0.5


def load_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@dataclass
class Example:
    query: str
    prompt: str
    sim: float
    label: int
    weight: float


def embed_qqp(rows: list[dict[str, Any]], cache: Path | None) -> tuple[np.ndarray, np.ndarray]:
    if cache is not None and cache.exists():
        data = np.load(cache)
        return data["a"], data["b"]
    embedder = SentenceTransformerEmbedder(EmbedderSpec())
    a = embedder.embed_batched([r["text_a"] for r in rows])
    b = embedder.embed_batched([r["text_b"] for r in rows])
    if cache is not None:
        np.savez(cache, a=a, b=b)
    return a, b


def top_candidates(
    queries: npt.NDArray[np.float32], prompts: npt.NDArray[np.float32], k: int
) -> tuple[np.ndarray, np.ndarray]:
    """Exact top-k prompt indices and similarities for each query."""
    sims = queries @ prompts.T
    idx = np.argpartition(-sims, kth=min(k, sims.shape[1] - 1), axis=1)[:, :k]
    part = np.take_along_axis(sims, idx, axis=1)
    order = np.argsort(-part, axis=1)
    return np.take_along_axis(idx, order, axis=1), np.take_along_axis(part, order, axis=1)


def build_examples(
    rows: list[dict[str, Any]], a: np.ndarray, b: np.ndarray, fit: list[int], mined: int
) -> list[Example]:
    out = [
        Example(rows[i]["text_b"], rows[i]["text_a"], float(a[i] @ b[i]), rows[i]["label"], 1.0)
        for i in fit
    ]
    if mined < 1:
        return out
    idx, sims = top_candidates(b[fit], a[fit], mined)
    for qi, i in enumerate(fit):
        for cand, sim in zip(idx[qi].tolist(), sims[qi].tolist(), strict=True):
            j = fit[cand]
            if rows[j]["text_a"] != rows[i]["text_a"] and sim >= MIN_SIMILARITY:
                out.append(Example(rows[i]["text_b"], rows[j]["text_a"], sim, 0, 1.0))
    return out


def hard_examples(
    embedder: SentenceTransformerEmbedder, split: str, weight: float
) -> list[Example]:
    rows = [r for r in load_jsonl(HARD_CASES) if r["split"] == split]
    va = embedder.embed([r["text_a"] for r in rows])
    vb = embedder.embed([r["text_b"] for r in rows])
    return [
        Example(r["text_b"], r["text_a"], float(x @ y), int(r["label"]), weight)
        for r, x, y in zip(rows, va, vb, strict=True)
    ]


def fit_weights(examples: list[Example], embedder_name: str) -> VerifierWeights:
    from sklearn.linear_model import LogisticRegression

    probe = LogisticVerifier(_identity_weights(embedder_name))
    x = np.array([probe.feature_vector(e.query, e.prompt, e.sim) for e in examples])
    y = np.array([e.label for e in examples])
    w = np.array([e.weight for e in examples])
    mean, scale = x.mean(axis=0), x.std(axis=0) + 1e-6
    model = LogisticRegression(C=1.0, max_iter=2000)
    model.fit((x - mean) / scale, y, sample_weight=w)
    return VerifierWeights(
        feature_names=FEATURE_NAMES,
        coef=tuple(float(c) for c in model.coef_[0]),
        intercept=float(model.intercept_[0]),
        mean=tuple(float(m) for m in mean),
        scale=tuple(float(s) for s in scale),
        threshold=0.5,
        min_similarity=MIN_SIMILARITY,
        embedder=embedder_name,
        meta={},
    )


def _identity_weights(embedder_name: str) -> VerifierWeights:
    n = len(FEATURE_NAMES)
    return VerifierWeights(FEATURE_NAMES, (0.0,) * n, 0.0, (0.0,) * n, (1.0,) * n, 0.5,
                           MIN_SIMILARITY, embedder_name, {})  # fmt: skip


def replay_scores(
    verifier: LogisticVerifier,
    rows: list[dict[str, Any]],
    a: np.ndarray,
    b: np.ndarray,
    queries: list[int],
    prompts: list[int],
) -> list[tuple[float, bool]]:
    """Best verifier score per query as the cache would see it, and whether it is correct."""
    idx, sims = top_candidates(b[queries], a[prompts], NUM_CANDIDATES)
    out: list[tuple[float, bool]] = []
    for qi, i in enumerate(queries):
        best, correct = 0.0, False
        for cand, sim in zip(idx[qi].tolist(), sims[qi].tolist(), strict=True):
            if sim < MIN_SIMILARITY:
                continue
            j = prompts[cand]
            score = verifier.score(rows[i]["text_b"], rows[j]["text_a"], sim)
            if score > best:
                best, correct = score, (j == i and rows[i]["label"] == 1)
        out.append((best, correct))
    return out


def choose_threshold(
    scored: list[tuple[float, bool]], positives: int, target: float, min_hits: int = 20
) -> dict[str, float]:
    """Lowest threshold whose replay precision is >= target; if none reaches it, the one
    with the best precision over at least ``min_hits`` hits."""
    ordered = sorted(scored, key=lambda s: -s[0])
    reached: dict[str, float] | None = None
    fallback = {"threshold": 0.99, "precision": 0.0, "recall": 0.0, "reached_target": 0.0}
    correct = 0
    for hits, (score, ok) in enumerate(ordered, start=1):
        correct += int(ok)
        point = {"threshold": score, "precision": correct / hits, "recall": correct / positives}
        if hits >= min_hits and correct / hits >= target:
            reached = {**point, "reached_target": 1.0}
        if hits >= min_hits and point["precision"] > fallback["precision"]:
            fallback = {**point, "reached_target": 0.0}
    return reached or fallback


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pairs", type=Path, default=DEFAULT_QQP)
    parser.add_argument("--embeddings-cache", type=Path, default=None)
    parser.add_argument("--target-precision", type=float, default=0.95)
    parser.add_argument("--hard-weight", type=float, default=5.0)
    parser.add_argument("--mined", type=int, default=NUM_CANDIDATES, help="negatives per query")
    parser.add_argument("--out", type=Path, default=WEIGHTS_OUT)
    args = parser.parse_args()

    rows = load_jsonl(args.pairs)
    a, b = embed_qqp(rows, args.embeddings_cache)
    splits = [qqp_split(r["text_a"], r["text_b"]) for r in rows]
    fit = [i for i, s in enumerate(splits) if s == "fit"]
    calib = [i for i, s in enumerate(splits) if s == "calib"]
    embedder = SentenceTransformerEmbedder(EmbedderSpec())
    examples = build_examples(rows, a, b, fit, args.mined)
    examples += hard_examples(embedder, "train", args.hard_weight)
    weights = fit_weights(examples, embedder.name)
    verifier = LogisticVerifier(weights)
    pairwise = [
        (
            verifier.score(rows[i]["text_b"], rows[i]["text_a"], float(a[i] @ b[i])),
            rows[i]["label"] == 1,
        )
        for i in calib
    ]
    positives = sum(rows[i]["label"] for i in calib)
    chosen = choose_threshold(pairwise, positives, args.target_precision)
    replay = replay_scores(verifier, rows, a, b, calib, fit + calib)
    hits = [ok for score, ok in replay if score >= chosen["threshold"]]
    strict = {"hits": len(hits), "precision": sum(hits) / max(1, len(hits)),
              "recall": sum(hits) / positives}  # fmt: skip
    meta = {
        "qqp_fit_pairs": len(fit), "qqp_calib_pairs": len(calib),
        "qqp_heldout_pairs": splits.count("heldout"), "examples": len(examples),
        "target_precision": args.target_precision, "mined": args.mined,
        "calib_pairwise": chosen, "calib_replay_strict": strict,
        "split_rule": "sha1(text_a TAB text_b)[:8] % 100: <20 heldout, <32 calib, else fit",
    }  # fmt: skip
    final = VerifierWeights.from_json(
        {**weights.to_json(), "threshold": chosen["threshold"], "meta": meta}
    )
    args.out.write_text(json.dumps(final.to_json(), indent=1) + "\n")
    report = {**meta, "coef": dict(zip(FEATURE_NAMES, final.coef, strict=True))}
    report["hard_heldout"] = evaluate_hard(LogisticVerifier(final), embedder, final.threshold)
    print(json.dumps(report, indent=1))


def evaluate_hard(
    verifier: LogisticVerifier, embedder: SentenceTransformerEmbedder, threshold: float
) -> dict[str, Any]:
    """Pairwise decisions on the held-out hand-written cases, per kind."""
    per_kind: dict[str, list[int]] = {}
    for e, kind in zip(
        hard_examples(embedder, "heldout", 1.0), _hard_kinds("heldout"), strict=True
    ):
        accept = verifier.score(e.query, e.prompt, e.sim) >= threshold
        per_kind.setdefault(kind, []).append(int(accept == bool(e.label)))
    return {k: {"correct": sum(v), "total": len(v)} for k, v in sorted(per_kind.items())}


def _hard_kinds(split: str) -> list[str]:
    return [r["kind"] for r in load_jsonl(HARD_CASES) if r["split"] == split]


if __name__ == "__main__":
    main()
