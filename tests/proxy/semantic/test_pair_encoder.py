"""The shipped pair encoder: batch-invariant vectors, its memo, and the verifier on top."""

from __future__ import annotations

import numpy as np
import pytest

from proxy.semantic.embedder import SentenceTransformerEmbedder
from proxy.semantic.pair_encoder import PairEncoder, PairEncoderConfig, is_shipped, load_shipped
from proxy.semantic.pair_verifier import PairEncoderVerifier, load_pair_encoder_verifier

TEXTS = [
    "How do I reset my password?",
    "What is the capital of France?",
    "What are the best ways to learn a new language as an adult with a full-time job?",
    "hi",
]

shipped = pytest.mark.skipif(not is_shipped(), reason="no pair-encoder weights in the package")


def test_config_round_trips() -> None:
    config = PairEncoderConfig({"hidden_size": 4}, 64, 0.6, {"coef": [1.0]}, {"x": 1})
    assert PairEncoderConfig.from_json(config.to_json()) == config


@pytest.fixture(scope="module")
def pair_verifier() -> PairEncoderVerifier:
    return load_pair_encoder_verifier()


@shipped
def test_a_texts_vector_does_not_depend_on_its_batch(pair_verifier: PairEncoderVerifier) -> None:
    model = pair_verifier.model
    for text in TEXTS:
        alone = model.embed([text])[0]
        first = model.embed([text, *TEXTS])[0]
        last = model.embed([*TEXTS, text])[-1]
        np.testing.assert_array_equal(alone, first)
        np.testing.assert_array_equal(alone, last)
        assert abs(float(np.linalg.norm(alone)) - 1.0) < 1e-5


@shipped
def test_memoised_prompts_give_the_same_cosines() -> None:
    config, arrays = load_shipped()
    memo = PairEncoder(config, arrays, memo_size=2)
    fresh = PairEncoder(config, arrays, memo_size=0)
    query, prompts = TEXTS[0], TEXTS[1:]
    first = memo.cosines(query, prompts)  # fills the memo (and evicts: 3 prompts, room for 2)
    again = memo.cosines(query, [*prompts, prompts[0]])
    expected = fresh.cosines(query, prompts)
    np.testing.assert_array_equal(first, expected)
    np.testing.assert_array_equal(again[:3], expected)
    assert again[3] == again[0]
    assert len(memo.cosines(query, [])) == 0


@shipped
def test_scores_in_a_batch_equal_scores_alone(pair_verifier: PairEncoderVerifier) -> None:
    query = TEXTS[0]
    candidates = [("How can I reset my password?", 0.9), (TEXTS[1], 0.2), (TEXTS[2], 0.4)]
    many = pair_verifier.score_many(query, candidates)
    one_by_one = [pair_verifier.score(query, p, s) for p, s in candidates]
    # the vectors and cosines are bit-identical; the stack's matrix product over several
    # rows may round its last bit differently from one row
    np.testing.assert_allclose(many, one_by_one, rtol=0, atol=1e-12)
    triples = pair_verifier.score_triples([(query, p, s) for p, s in candidates])
    np.testing.assert_allclose(triples, many, rtol=0, atol=1e-12)
    assert many[0] > many[2] and many[0] > many[1]


@shipped
def test_exact_repeats_score_one_and_operators_zero(pair_verifier: PairEncoderVerifier) -> None:
    assert pair_verifier.score("Who wrote Hamlet?", "who wrote hamlet", 0.99) == 1.0
    assert pair_verifier.score("What is 10 - 4?", "What is 10 + 4?", 0.99) == 0.0
    config, _ = load_shipped()
    assert 0.5 < pair_verifier.default_threshold < 1.0 and 0.0 < config.min_similarity < 1.0


@shipped
def test_the_hand_written_near_misses_are_not_served(
    embedder: SentenceTransformerEmbedder, pair_verifier: PairEncoderVerifier
) -> None:
    """The logistic verifier's near-miss list (negation, numbers, units, entities,
    direction, opposite verbs, operators, swaps), through the pair encoder."""
    from tests.proxy.semantic.test_verifier import NEAR_MISSES, SWAPS_AND_QUESTION_WORDS

    for kind, cached, query in NEAR_MISSES + SWAPS_AND_QUESTION_WORDS:
        va, vb = embedder.embed([cached, query])
        score = pair_verifier.score(query, cached, float(va @ vb))
        assert score < pair_verifier.default_threshold, f"{kind}: served {query!r} for {cached!r}"
