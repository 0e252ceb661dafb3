"""The shipped verifier on near-misses similarity alone accepts, and on paraphrases."""

from __future__ import annotations

import pytest

from proxy.semantic.embedder import SentenceTransformerEmbedder
from proxy.semantic.verifier import LogisticVerifier

NEAR_MISSES = [
    ("negation", "What foods are safe for dogs?", "What foods are not safe for dogs?"),
    ("negation", "Why does my laptop turn on?", "Why doesn't my laptop turn on?"),
    ("numbers", "How many calories are in 2 eggs?", "How many calories are in 3 eggs?"),
    ("numbers", "Who won the World Cup in 2014?", "Who won the World Cup in 2018?"),
    ("units", "How long does it take to run 5 km?", "How long does it take to run 5 miles?"),
    ("entities", "How do I install Docker on Ubuntu?", "How do I install Docker on Windows?"),
    ("entities", "Why did Germany invade Poland?", "Why did Poland invade Germany?"),
    (
        "direction",
        "How do I get from Paris to London by train?",
        "How do I get from London to Paris by train?",
    ),
    (
        "direction",
        "How do I convert Celsius to Fahrenheit?",
        "How do I convert Fahrenheit to Celsius?",
    ),
    ("opposite", "How do I enable dark mode on Windows?", "How do I disable dark mode on Windows?"),
    ("opposite", "When is the best time to buy Bitcoin?", "When is the best time to sell Bitcoin?"),
    ("opposite", "How can I increase my credit score?", "How can I decrease my credit score?"),
    ("operator", "What is 10 - 4?", "What is 10 + 4?"),
    ("operator", "Is 10 < 4?", "Is 10 > 4?"),
]
PARAPHRASES = [
    ("How do I reset my password?", "How can I reset my password?"),
    ("What is the capital of France?", "What's the capital of France?"),
    ("How do I install Docker on Ubuntu?", "How can I install Docker on Ubuntu?"),
    ("How do I hide a column in Excel?", "How can I hide a column in Excel?"),
    ("Who wrote Hamlet?", "who wrote hamlet"),
]


def decide(
    embedder: SentenceTransformerEmbedder, verifier: LogisticVerifier, a: str, b: str
) -> tuple[float, bool]:
    va, vb = embedder.embed([a, b])
    sim = float(va @ vb)
    return sim, verifier.score(b, a, sim) >= verifier.default_threshold


@pytest.mark.parametrize(("kind", "cached", "query"), NEAR_MISSES)
def test_near_misses_are_rejected(
    embedder: SentenceTransformerEmbedder,
    verifier: LogisticVerifier,
    kind: str,
    cached: str,
    query: str,
) -> None:
    sim, accepted = decide(embedder, verifier, cached, query)
    assert sim > 0.75, f"{kind}: not a near miss for the embedder (sim {sim:.2f})"
    assert not accepted, f"{kind}: accepted {query!r} for {cached!r} (sim {sim:.2f})"


@pytest.mark.parametrize(("cached", "query"), PARAPHRASES)
def test_paraphrases_are_accepted(
    embedder: SentenceTransformerEmbedder, verifier: LogisticVerifier, cached: str, query: str
) -> None:
    sim, accepted = decide(embedder, verifier, cached, query)
    assert accepted, f"rejected {query!r} for {cached!r} (sim {sim:.2f})"


def test_guards_fire_on_their_cases(verifier: LogisticVerifier) -> None:
    names = verifier.weights.feature_names

    def fv(a: str, b: str) -> dict[str, float]:
        return dict(zip(names, verifier.feature_vector(a, b, 0.9), strict=True))

    assert fv("Is coffee bad?", "Is coffee not bad?")["negation"] == 1
    assert fv("Is coffee bad?", "Isn't coffee bad?")["negation"] == 1
    assert fv("Price of 2 eggs", "Price of two eggs")["numbers"] == 0
    assert fv("Run 5 km", "Run 5 miles")["units"] == 1
    assert fv("Did Apple buy Beats?", "Did Beats buy Apple?")["entity_swap"] == 1
    assert fv("Flights from Rome to Oslo", "Flights from Oslo to Rome")["direction"] == 1
    assert fv("Flights to Oslo", "Flights from Oslo")["direction"] == 1
    assert fv("How to enable SSH", "How to disable SSH")["opposite"] == 1
    assert fv("Who bought Beats?", "Who sold Beats?")["opposite"] == 1
    assert fv("How do I learn Python?", "How can I learn Python?")["opposite"] == 0
