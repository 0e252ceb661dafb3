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


SWAPS_AND_QUESTION_WORDS = [
    ("swap", "Why do cats chase dogs?", "Why do dogs chase cats?"),
    ("swap", "Is tea healthier than coffee?", "Is coffee healthier than tea?"),
    ("question_word", "Why did the Roman Empire fall?", "When did the Roman Empire fall?"),
]


@pytest.mark.parametrize(("kind", "cached", "query"), NEAR_MISSES + SWAPS_AND_QUESTION_WORDS)
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


def test_change_guards_tell_substitution_from_addition(verifier: LogisticVerifier) -> None:
    names = verifier.weights.feature_names

    def fv(a: str, b: str) -> dict[str, float]:
        return dict(zip(names, verifier.feature_vector(a, b, 0.9), strict=True))

    year = fv("Who won the Super Bowl in 2014?", "Who won the Super Bowl in 2009?")
    assert (year["number_sub"], year["number_add"]) == (1, 0)
    added = fv("Best thriller movies of 2015?", "Best thriller movies?")
    assert (added["number_sub"], added["number_add"]) == (0, 1)
    county = fv("Rehab centers in Alpine County?", "Rehab centers in Lake County?")
    assert (county["entity_sub"], county["entity_add"]) == (1, 0)
    assert fv("When is Delhi's monsoon?", "When is Mumbai's monsoon?")["entity_sub"] == 1
    # a name used in both questions, swapped in one place: the multisets differ
    muggles = fv(
        "In a war between Muggles and Wizards, what can the Muggles use?",
        "In a war between Muggles and Wizards, what can the Wizards use?",
    )
    assert muggles["content_sub"] == 1 and muggles["unmatched"] == 0
    detail = fv("Which treatment for asthma in children?", "Which treatment for asthma?")
    assert (detail["only_query"], detail["only_prompt"], detail["content_add"]) == (1 / 3, 0, 1)


def test_swap_pointer_question_word_and_coordination(verifier: LogisticVerifier) -> None:
    names = verifier.weights.feature_names

    def fv(a: str, b: str) -> dict[str, float]:
        return dict(zip(names, verifier.feature_vector(a, b, 0.9), strict=True))

    assert fv("What do boys dislike about girls?", "What do girls dislike about boys?")["swap"] == 1
    coordinated = fv(
        "Differences between Chinese culture and western culture?",
        "Differences between western culture and Chinese culture?",
    )
    assert coordinated["swap"] == 0 and coordinated["reorder"] == 1
    assert fv("Which breed is this dog?", "Which breed is a beagle?")["pointer"] == 1
    assert fv("What type of insect is that?", "What type of insect bites?")["pointer"] == 1
    assert fv("How do I learn Python?", "How can I learn Python?")["pointer"] == 0
    assert fv("How does photosynthesis work?", "Why does photosynthesis work?")["wh_class"] == 1
    assert fv("How do I learn Python?", "What is the best way to learn Python?")["wh_class"] == 0
    assert fv("What is speed?", "What is speed and velocity?")["coordination"] == 1


def test_score_many_matches_one_at_a_time(
    embedder: SentenceTransformerEmbedder, verifier: LogisticVerifier
) -> None:
    query = "How can I reset my password?"
    prompts = [
        "How do I reset my password?",
        "how can i reset my password",  # exact repeat: 1.0
        "How do I reset my router?",
        "What is 10 - 4?",  # operators differ: 0.0
    ]
    vectors = embedder.embed([query, *prompts])
    candidates = [(p, float(vectors[0] @ v)) for p, v in zip(prompts, vectors[1:], strict=True)]
    many = verifier.score_many(query, candidates)
    assert many == pytest.approx([verifier.score(query, p, s) for p, s in candidates], rel=1e-12)
    assert many[1] == 1.0 and many[3] == 0.0 and 0.0 < many[2] < many[0] < 1.0
    assert verifier.score_many(query, []) == []


def test_parse_cache_is_bounded_and_changes_no_score(verifier: LogisticVerifier) -> None:
    small = LogisticVerifier(verifier.weights, parse_cache_size=2)
    uncached = LogisticVerifier(verifier.weights, parse_cache_size=0)
    texts = [f"How do I repair a bike in {city}?" for city in ("Oslo", "Rome", "Lima", "Oslo")]
    for text in texts:
        assert small.score(texts[0], text, 0.9) == uncached.score(texts[0], text, 0.9)
    first = small.parse(texts[0])
    assert small.parse(texts[0]) is first  # served from the LRU
    small.parse(texts[1])
    small.parse(texts[2])  # a third text: the least recently used one goes
    assert small.parse(texts[0]) is not first and small.parse(texts[0]) == first
    assert uncached.parse(texts[0]) is not uncached.parse(texts[0])
    with pytest.raises(ValueError):
        LogisticVerifier(verifier.weights, parse_cache_size=-1)
