"""Per-query curve, operating point, the peer's wrong hits at our hit count, pairwise AP."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.semantic.pair_metrics import average_precision, roc_auc
from bench.semantic.readings import QueryOutcomes, curve, pairwise, point, wrong_at_hits

NONE = -math.inf


def test_point_counts_hits_at_the_threshold() -> None:
    o = QueryOutcomes.of([0.9, 0.8, 0.4, NONE], [True, False, True, False], positives=3)
    at = point(o, 0.5)
    assert at["hits"] == 2 and at["correct_hits"] == 1 and at["false_hits"] == 1
    assert at["precision"] == 0.5 and at["recall"] == round(1 / 3, 4) and at["hit_rate"] == 0.5
    assert at["false_hits_per_1000_queries"] == 250.0
    assert point(o, 2.0)["precision"] is None


def test_curve_ends_where_every_candidate_is_served() -> None:
    o = QueryOutcomes.of([0.9, 0.8, 0.4, NONE], [True, False, True, False], positives=3)
    pts = curve(o, points=10)
    assert pts[0]["precision"] == 1.0 and pts[0]["hit_rate"] == 0.25
    assert pts[-1]["hit_rate"] == 0.75 and pts[-1]["recall"] == round(2 / 3, 5)
    assert curve(QueryOutcomes.of([NONE], [False], 0)) == []


def test_wrong_at_hits_reads_the_peers_best_queries() -> None:
    peer = QueryOutcomes.of([0.95, 0.9, 0.85, 0.7], [False, True, True, True], positives=4)
    at = wrong_at_hits(peer, 2)
    assert at == {"hits": 2, "false_hits": 1, "precision": 0.5, "threshold": 0.9}


@given(st.lists(st.tuples(st.floats(0, 1), st.booleans()), min_size=2, max_size=60))
def test_ap_and_auc_match_their_definitions(rows: list[tuple[float, bool]]) -> None:
    scores = [s for s, _ in rows]
    labels = [int(y) for _, y in rows]
    if 0 < sum(labels) < len(labels):
        pos = [s for s, y in rows if y]
        neg = [s for s, y in rows if not y]
        expected = np.mean([1.0 if p > n else 0.5 if p == n else 0.0 for p in pos for n in neg])
        assert roc_auc(scores, labels) == pytest.approx(expected)
    if sum(labels):
        assert 0.0 < average_precision(scores, labels) <= 1.0


def test_pairwise_ap_is_one_for_a_perfect_ranking() -> None:
    out = pairwise([0.9, 0.8, 0.2, 0.1], [1, 1, 0, 0], 0.5)
    assert out["average_precision"] == 1.0 and out["roc_auc"] == 1.0
    assert out["precision"] == 1.0 and out["recall"] == 1.0
    decided = pairwise([0.9, 0.8, 0.2, 0.1], [1, 1, 0, 0], 0.5, decided=[True, False, False, False])
    assert decided["recall"] == 0.5
