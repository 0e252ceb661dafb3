"""The traced encoder computes the vectors the eager one does (the verifier was
trained on eager vectors), for single queries and padded batches alike."""

from __future__ import annotations

import numpy as np

from proxy.semantic.embedder import EmbedderSpec, SentenceTransformerEmbedder

TEXTS = [
    "Buy BTC now?",
    "How do I reset my password on the website?",
    "How can I increase my height after 21 years of age, is it possible or not at all?",
    "What is the capital city of Australia, and why is it not Sydney?",
]


def test_traced_vectors_equal_eager_vectors(embedder: SentenceTransformerEmbedder) -> None:
    assert EmbedderSpec().trace  # the default the rest of these tests use
    eager = SentenceTransformerEmbedder(EmbedderSpec(trace=False))
    for text in TEXTS:  # one query at a time (each its own sequence length)
        np.testing.assert_allclose(embedder.embed([text]), eager.embed([text]), atol=1e-5)
    batch = embedder.embed(TEXTS)  # one padded batch
    np.testing.assert_allclose(batch, eager.embed(TEXTS), atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(batch, axis=1), 1.0, atol=1e-5)
