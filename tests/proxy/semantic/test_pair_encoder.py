"""The shipped pair encoder as the cache's embedder: batch-invariant vectors, a name
that identifies its weights, one forward per lookup, and the verifier stacked on the
index's cosine."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from proxy.semantic.embedder import SentenceTransformerEmbedder
from proxy.semantic.factory import build_pair
from proxy.semantic.pair_encoder import (
    PairEncoder,
    PairEncoderConfig,
    is_shipped,
    load_shipped,
    weights_digest,
)
from proxy.semantic.pair_verifier import PairEncoderVerifier, load_pair_encoder_verifier
from proxy.semantic.service import SemanticCache
from proxy.semantic.store import InMemoryStore
from tests.proxy.semantic.semantic_helpers import answer, chat

TEXTS = [
    "How do I reset my password?",
    "What is the capital of France?",
    "What are the best ways to learn a new language as an adult with a full-time job?",
    "hi",
]

shipped = pytest.mark.skipif(not is_shipped(), reason="no pair-encoder weights in the package")
pytestmark = pytest.mark.anyio


def test_config_round_trips() -> None:
    config = PairEncoderConfig({"hidden_size": 4}, 64, 0.6, {"coef": [1.0]}, {"x": 1})
    assert PairEncoderConfig.from_json(config.to_json()) == config


def test_the_digest_names_the_weights() -> None:
    arrays = {"a": np.arange(6, dtype=np.int8).reshape(2, 3), "b": np.ones(3, np.float16)}
    same = {"b": np.ones(3, np.float16), "a": np.arange(6, dtype=np.int8).reshape(2, 3)}
    assert weights_digest(arrays) == weights_digest(same)
    changed = dict(arrays, a=arrays["a"] + 1)
    reshaped = dict(arrays, a=arrays["a"].reshape(3, 2))
    assert len({weights_digest(arrays), weights_digest(changed), weights_digest(reshaped)}) == 3


@pytest.fixture(scope="module")
def pair_encoder() -> PairEncoder:
    if not is_shipped():
        pytest.skip("no pair-encoder weights in the package")
    config, arrays = load_shipped()
    return PairEncoder(config, arrays)


@shipped
def test_a_texts_vector_does_not_depend_on_its_batch(pair_encoder: PairEncoder) -> None:
    for text in TEXTS:
        alone = pair_encoder.embed([text])[0]
        first = pair_encoder.embed([text, *TEXTS])[0]
        last = pair_encoder.embed([*TEXTS, text])[-1]
        np.testing.assert_array_equal(alone, first)
        np.testing.assert_array_equal(alone, last)
        assert abs(float(np.linalg.norm(alone)) - 1.0) < 1e-5
    assert pair_encoder.embed(TEXTS).shape == (len(TEXTS), pair_encoder.dim)


@shipped
def test_the_verifier_reads_the_encoders_cosines(pair_encoder: PairEncoder) -> None:
    verifier = load_pair_encoder_verifier()
    assert verifier.embedder == pair_encoder.name
    assert pair_encoder.name.startswith("kvtoll-pair-encoder/")
    query, prompts = TEXTS[0], ["How can I reset my password?", TEXTS[1], TEXTS[2]]
    vectors = pair_encoder.embed([query, *prompts])
    cosines = [float(v @ vectors[0]) for v in vectors[1:]]
    many = verifier.score_many(query, list(zip(prompts, cosines, strict=True)))
    one_by_one = [verifier.score(query, p, s) for p, s in zip(prompts, cosines, strict=True)]
    np.testing.assert_allclose(many, one_by_one, rtol=0, atol=1e-12)
    assert many[0] > 0.5 > max(many[1:])
    # The score follows the cosine handed over (no model of its own): a lower cosine,
    # a lower score.
    assert verifier.score(query, prompts[0], cosines[0] - 0.3) < many[0]


@shipped
def test_exact_repeats_score_one_and_operators_zero() -> None:
    verifier = load_pair_encoder_verifier()
    assert verifier.score("Who wrote Hamlet?", "who wrote hamlet", 0.99) == 1.0
    assert verifier.score("What is 10 - 4?", "What is 10 + 4?", 0.99) == 0.0
    config, _ = load_shipped()
    assert 0.5 < verifier.default_threshold < 1.0 and 0.0 < config.min_similarity < 1.0


def test_the_verifier_refuses_another_embedders_cosines(
    embedder: SentenceTransformerEmbedder,
) -> None:
    config = PairEncoderConfig({"hidden_size": 384}, 64, 0.6, _stack_json())
    verifier = PairEncoderVerifier(config, "kvtoll-pair-encoder/000000000000/int8-row")
    with pytest.raises(ValueError, match="cosines"):
        SemanticCache(embedder, InMemoryStore(), verifier)


class CountingEmbedder:
    """The real pair encoder, counting the texts each forward call embeds."""

    def __init__(self, inner: PairEncoder) -> None:
        self.inner = inner
        self.calls: list[int] = []

    @property
    def dim(self) -> int:
        return self.inner.dim

    @property
    def name(self) -> str:
        return self.inner.name

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        self.calls.append(len(texts))
        return self.inner.embed(texts)


@shipped
async def test_a_lookup_embeds_once_and_serves_a_paraphrase(pair_encoder: PairEncoder) -> None:
    built, verifier = build_pair("pair-encoder")
    assert built.name == pair_encoder.name
    counting = CountingEmbedder(pair_encoder)
    cache = SemanticCache(counting, InMemoryStore(), verifier)
    try:
        await cache.store("t", chat("How do I reset my password?"), answer("Click 'forgot'"))
        await cache.store("t", chat("What is the capital of France?"), answer("Paris"))
        counting.calls.clear()
        result = await cache.lookup_detailed("t", chat("How can I reset my password?"))
        assert result.hit is not None and result.hit.entry is not None
        assert result.hit.entry.prompt == "How do I reset my password?"
        assert result.hit.entry.embedder == pair_encoder.name
        assert counting.calls == [1]  # the query, once: candidates are read from the index
        near_miss = await cache.lookup_detailed("t", chat("What is the capital of Germany?"))
        assert near_miss.hit is None
        assert counting.calls == [1, 1]
    finally:
        await cache.aclose()


def _stack_json() -> dict[str, object]:
    from proxy.semantic.verifier import load_weights

    return load_weights().to_json()
