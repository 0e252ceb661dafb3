"""The two readings of a pair bench, from per-query and per-pair scores (pure numpy).

Per query: each query ends with its best-scored candidate (or none); at a threshold
``t`` it is a hit when that score is ``>= t``, and a correct hit when the candidate is
its own pair's stored prompt and the pair's label is 1, or an exact repeat of the query
(:func:`curve`, :func:`point`). Pairwise: each pair's two texts scored directly
(:func:`pairwise`). :func:`wrong_at_hits` reads a peer's curve at another policy's
hit count ("how many wrong hits would the peer serve to hit as often").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from bench.semantic.pair_metrics import average_precision, roc_auc


@dataclass(frozen=True)
class QueryOutcomes:
    """Per query: best candidate's score (-inf: no candidate) and whether it is right."""

    scores: np.ndarray  # float64, one per query
    correct: np.ndarray  # bool: serving the best candidate would be a correct hit
    positives: int  # label-1 queries (recall's denominator)

    @staticmethod
    def of(scores: Sequence[float], correct: Sequence[bool], positives: int) -> QueryOutcomes:
        s = np.asarray(scores, dtype=np.float64)
        c = np.asarray(correct, dtype=bool)
        if s.shape != c.shape:
            raise ValueError("one correctness flag per score")
        return QueryOutcomes(s, c, int(positives))


def point(outcomes: QueryOutcomes, threshold: float) -> dict[str, Any]:
    """Precision, recall, hit rate and false hits per 1,000 queries at ``threshold``."""
    hit = outcomes.scores >= threshold
    hits = int(hit.sum())
    correct = int((hit & outcomes.correct).sum())
    n = len(outcomes.scores)
    return {
        "threshold": round(float(threshold), 6),
        "precision": round(correct / hits, 4) if hits else None,
        "recall": round(correct / outcomes.positives, 4) if outcomes.positives else None,
        "hit_rate": round(hits / n, 4) if n else None,
        "hits": hits,
        "correct_hits": correct,
        "false_hits": hits - correct,
        "false_hits_per_1000_queries": round(1000 * (hits - correct) / n, 2) if n else None,
    }


def curve(outcomes: QueryOutcomes, points: int = 60) -> list[dict[str, Any]]:
    """Precision / hit rate / recall as the threshold falls (``points`` hit counts,
    evenly spaced from one hit to every query that has a candidate)."""
    finite = np.isfinite(outcomes.scores)
    order = np.argsort(-outcomes.scores, kind="stable")[: int(finite.sum())]
    if not len(order):
        return []
    correct = np.cumsum(outcomes.correct[order])
    n = len(outcomes.scores)
    out = []
    for k in sorted({int(x) for x in np.linspace(1, len(order), points)}):
        out.append({
            "threshold": round(float(outcomes.scores[order[k - 1]]), 6),
            "hit_rate": round(k / n, 5),
            "precision": round(float(correct[k - 1]) / k, 5),
            "recall": round(float(correct[k - 1]) / max(1, outcomes.positives), 5),
        })  # fmt: skip
    return out


def wrong_at_hits(outcomes: QueryOutcomes, hits: int) -> dict[str, Any]:
    """The peer's ``hits`` best-scored queries: how many of them are wrong."""
    order = np.argsort(-outcomes.scores, kind="stable")
    order = order[np.isfinite(outcomes.scores[order])][:hits]
    wrong = int(len(order) - outcomes.correct[order].sum())
    return {
        "hits": len(order),
        "false_hits": wrong,
        "precision": round(1 - wrong / len(order), 4) if len(order) else None,
        "threshold": round(float(outcomes.scores[order[-1]]), 6) if len(order) else None,
    }


def pairwise(scores: Sequence[float], labels: Sequence[int], threshold: float,
             decided: Sequence[bool] | None = None) -> dict[str, Any]:
    """Pairwise precision / recall at ``threshold`` and the ranking's AP and ROC AUC.

    ``decided`` (optional): the cache's own decision per pair (the threshold and the
    similarity floor); precision and recall then read it instead of ``scores >= t``."""
    s = np.asarray(scores, dtype=np.float64)
    y = np.asarray(labels, dtype=np.int64)
    accept = s >= threshold if decided is None else np.asarray(decided, dtype=bool)
    tp = int((accept & (y == 1)).sum())
    return {
        "pairs": len(y),
        "positives": int(y.sum()),
        "threshold": round(float(threshold), 6),
        "precision": round(tp / int(accept.sum()), 4) if accept.any() else None,
        "recall": round(tp / int(y.sum()), 4) if y.sum() else None,
        "average_precision": round(average_precision(s, y), 4),
        "roc_auc": round(roc_auc(s, y), 4),
    }
