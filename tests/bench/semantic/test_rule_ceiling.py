"""The own-pair rule's precision ceiling reported by ``kvtoll bench semantic``."""

from __future__ import annotations

from bench.semantic.evaluate import Pair, rule_ceiling


def test_queries_identical_to_another_pairs_prompt_cap_precision() -> None:
    pairs = [
        Pair("How do I bake bread?", "What is the way to bake bread?", 1),
        Pair("What is the way to bake bread?", "How to bake a loaf?", 1),  # text_b above is this
        Pair("Is Paris in France?", "Is Paris in France?", 1),  # own prompt: not forced
        Pair("Why is the sky blue?", "How do I bake bread?", 0),  # forced, label 0
        Pair("Best laptop for coding?", "Top laptop for programming?", 0),
    ]
    ceiling = rule_ceiling(pairs, range(len(pairs)))
    assert ceiling["queries_identical_to_another_pairs_prompt"] == 2
    # positives 3; pair 0 is forced (its text_b is pair 1's prompt): 2 achievable, 2 forced
    assert ceiling["max_precision"] == 0.5
    assert ceiling["max_recall"] == round(2 / 3, 4)


def test_no_forced_queries_means_no_cap() -> None:
    pairs = [Pair("a b c", "a b d", 1), Pair("x y", "x z", 0)]
    assert rule_ceiling(pairs, [0, 1]) == {
        "queries_identical_to_another_pairs_prompt": 0,
        "max_precision": 1.0,
        "max_recall": 1.0,
    }
