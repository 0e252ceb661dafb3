"""The three precision views of ``kvtoll bench semantic`` on hand-counted outcomes."""

from __future__ import annotations

import pytest

from bench.semantic.evaluate import Pair
from bench.semantic.pair_metrics import forced_queries, precision_views, summary


def test_forced_queries_are_other_pairs_prompts_only() -> None:
    pairs = [
        Pair("How do I bake bread?", "What is the way to bake bread?", 1),
        Pair("What is the way to bake bread?", "How to bake a loaf?", 1),
        Pair("Is Paris in France?", "Is Paris in France?", 1),  # its own prompt
    ]
    assert forced_queries(pairs, [0, 1, 2]) == {0}
    assert forced_queries(pairs, [1, 2]) == set()


def test_views_count_each_outcome_where_it_belongs() -> None:
    outcomes = ["correct", "correct", "own_label_0", "other_entry", "other_entry", "miss"]
    labels = [1, 1, 0, 1, 0, 1]
    forced = [False, False, False, True, False, False]
    views = precision_views(outcomes, labels, forced)
    assert views["strict"]["hits"] == 5 and views["strict"]["precision"] == 0.4
    assert views["strict"]["recall"] == 0.5  # 2 of 4 positives
    excluding = views["excluding_forced"]
    assert excluding["queries"] == 5 and excluding["hits"] == 4
    assert excluding["precision"] == 0.5 and excluding["recall"] == round(2 / 3, 4)
    assert views["own_pair"] == {"precision": round(2 / 3, 4), "own_pair_hits": 3,
                                 "own_pair_label_0": 1}  # fmt: skip


def test_no_hits_has_no_precision() -> None:
    assert summary(["miss", "miss"], [1, 0])["precision"] is None
    assert precision_views(["miss"], [0], [False])["own_pair"]["precision"] is None
    with pytest.raises(ValueError):
        summary(["miss"], [])
