"""The traced encoder computes the vectors the eager one does (the verifier was
trained on eager vectors), for single queries and padded batches alike."""

from __future__ import annotations

import threading

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


def test_concurrent_calls_from_limited_worker_threads(
    embedder: SentenceTransformerEmbedder,
) -> None:
    """The batcher's workers call ``embed`` at once, each on one intra-op thread: no
    call fails (the tokenizer is shared) and each gets the vectors of a lone call."""
    from proxy.semantic.omp_threads import limit_this_thread

    expected = [embedder.embed([t]) for t in TEXTS]
    errors: list[BaseException] = []
    results: list[tuple[int, np.ndarray]] = []

    def worker(offset: int) -> None:
        limit_this_thread(1)
        try:
            for n in range(12):
                i = (n + offset) % len(TEXTS)
                results.append((i, embedder.embed([TEXTS[i]])))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(results) == 36
    for i, vector in results:
        np.testing.assert_allclose(vector, expected[i], atol=1e-5)


MIXED = [
    "hi",
    "What is the capital of France and why do so many tourists visit it every summer?",
    "How do I learn Java fast?",
    "Why are the 1990s considered the best decade for music by so many people around the world?",
]


def test_a_texts_vector_does_not_depend_on_its_batch(
    embedder: SentenceTransformerEmbedder,
) -> None:
    """Issue 23 item 7: int8 activations are quantized per row and each text runs at its
    own padded length, so alone, first or last in a mixed batch it gets one vector."""
    for text in TEXTS:
        alone = embedder.embed([text])[0]
        first = embedder.embed([text, *MIXED])[0]
        last = embedder.embed([*MIXED, text])[-1]
        np.testing.assert_allclose(first, alone, atol=1e-6, rtol=0)
        np.testing.assert_allclose(last, alone, atol=1e-6, rtol=0)


def test_torch_dynamic_quantization_would_depend_on_the_batch() -> None:
    """The peer this replaced: one activation scale per batch moves a text's vector
    (so the test above can tell the difference)."""
    import torch
    from torch.ao.quantization import quantize_dynamic

    eager = SentenceTransformerEmbedder(EmbedderSpec(quantize=False, trace=False))
    bert = quantize_dynamic(eager._bert, {torch.nn.Linear}, dtype=torch.qint8)
    tok = eager._tokenizer

    def first_row(texts: list[str]) -> np.ndarray:
        enc = tok(texts, padding=True, return_tensors="pt")
        with torch.inference_mode():
            hidden = bert(**enc).last_hidden_state[0]
        return hidden[: int(enc["attention_mask"][0].sum())].mean(0).numpy()

    alone, inside = first_row([TEXTS[1]]), first_row([TEXTS[1], *MIXED])
    assert float(np.abs(alone - inside).max()) > 1e-3
