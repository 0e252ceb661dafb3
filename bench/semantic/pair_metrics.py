"""Precision and recall of a pair benchmark, under the own-pair rule and two views of it.

Each query (a pair's ``text_b``) ends in one outcome: ``miss``, ``correct`` (its own
pair's entry, label 1), ``own_label_0`` (its own pair's entry, label 0) or
``other_entry`` (some other pair's entry). Three precisions are reported:

* ``strict``: correct / hits (the issue's rule).
* ``excluding_forced``: the same over the queries that are *not* character for
  character another pair's stored prompt. Any cache serves such a query its identical
  stored prompt, and the rule counts that false (see :func:`forced_queries`).
* ``own_pair``: correct / (correct + own_label_0): of the hits that returned the
  query's own pair, the share whose label says it is a duplicate. This is what the
  verifier's decision alone is responsible for.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

OUTCOMES = ("miss", "correct", "own_label_0", "other_entry")


class LabelledPair(Protocol):
    @property
    def text_a(self) -> str: ...

    @property
    def text_b(self) -> str: ...

    @property
    def label(self) -> int: ...


def forced_queries(pairs: Sequence[LabelledPair], queries: Sequence[int]) -> set[int]:
    """Queries whose text is another pair's stored ``text_a`` (and not their own)."""
    stored = {p.text_a for p in pairs}
    return {i for i in queries if pairs[i].text_b in stored and pairs[i].text_b != pairs[i].text_a}


def summary(outcomes: Sequence[str], labels: Sequence[int]) -> dict[str, Any]:
    """Counts, precision, recall and hit rate of one set of queries."""
    if len(outcomes) != len(labels):
        raise ValueError("one label per outcome")
    hits = sum(1 for o in outcomes if o != "miss")
    correct = sum(1 for o in outcomes if o == "correct")
    positives = sum(labels)
    return {
        "precision": round(correct / hits, 4) if hits else None,
        "recall": round(correct / positives, 4) if positives else None,
        "hit_rate": round(hits / len(outcomes), 4) if outcomes else None,
        "hits": hits,
        "correct_hits": correct,
        "false_hits": hits - correct,
    }


def precision_views(
    outcomes: Sequence[str], labels: Sequence[int], forced: Sequence[bool]
) -> dict[str, Any]:
    """``strict``, ``excluding_forced`` and ``own_pair`` figures (module docstring)."""
    keep = [i for i, f in enumerate(forced) if not f]
    correct = sum(1 for o in outcomes if o == "correct")
    own = correct + sum(1 for o in outcomes if o == "own_label_0")
    return {
        "strict": summary(outcomes, labels),
        "excluding_forced": {
            "queries": len(keep),
            **summary([outcomes[i] for i in keep], [labels[i] for i in keep]),
        },
        "own_pair": {
            "precision": round(correct / own, 4) if own else None,
            "own_pair_hits": own,
            "own_pair_label_0": own - correct,
        },
    }


def average_precision(scores: Sequence[float] | Any, labels: Sequence[int] | Any) -> float:
    """Mean of the precision at each positive's rank, pairs ranked by score (ties in
    input order); scikit-learn's ``average_precision_score`` without interpolation."""
    import numpy as np

    s = np.asarray(scores, dtype=np.float64)
    y = np.asarray(labels, dtype=np.int64)
    if not y.sum():
        raise ValueError("average precision needs a positive")
    order = np.argsort(-s, kind="stable")
    hits = np.cumsum(y[order])
    ranks = np.arange(1, len(y) + 1)
    return float(np.sum((hits / ranks)[y[order] == 1]) / y.sum())


def roc_auc(scores: Sequence[float] | Any, labels: Sequence[int] | Any) -> float:
    """Probability that a random positive outscores a random negative (ties count half)."""
    import numpy as np

    s = np.asarray(scores, dtype=np.float64)
    y = np.asarray(labels, dtype=np.int64)
    positives, negatives = int(y.sum()), int(len(y) - y.sum())
    if not positives or not negatives:
        raise ValueError("ROC AUC needs both labels")
    order = np.argsort(s, kind="stable")
    ordered = s[order]
    ranks = np.empty(len(s), dtype=np.float64)
    start = 0
    while start < len(s):  # tied scores share the mean of their ranks
        end = start
        while end + 1 < len(s) and ordered[end + 1] == ordered[start]:
            end += 1
        ranks[order[start : end + 1]] = (start + end) / 2 + 1
        start = end + 1
    return float((ranks[y == 1].sum() - positives * (positives + 1) / 2) / (positives * negatives))
