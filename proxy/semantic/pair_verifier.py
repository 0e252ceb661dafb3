"""Second stage with the fine-tuned pair encoder (:mod:`proxy.semantic.pair_encoder`).

The index's candidates at or above ``min_similarity`` (a recall-first cosine floor
fitted on the calib split) are scored by the pair encoder: the query is encoded once
(the candidates' vectors mostly come from its memo), and each candidate's tuned cosine
goes with the pair's texts into a :class:`proxy.semantic.verifier.LogisticVerifier`
whose weights (the config's ``stack``) were fitted on the calib split: the guard
features catch what a pooled cosine misses (swapped entities, negation, numbers). As the
other verifiers do, an exact repeat (case, spacing and final punctuation aside) scores 1
and a different arithmetic operator scores 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from proxy.semantic.pair_encoder import PairEncoder, load_shipped
from proxy.semantic.verifier import LogisticVerifier, VerifierWeights, rule_score


class PairEncoderVerifier:
    """Scores candidates with the fine-tuned pair encoder (see the module docstring)."""

    runs_model = True  # the service runs it on the embedder's worker pool

    def __init__(
        self,
        model: PairEncoder,
        *,
        threshold: float | None = None,
        min_similarity: float | None = None,
    ) -> None:
        self._model = model
        self._stack = LogisticVerifier(VerifierWeights.from_json(model.config.stack))
        self._threshold = self._stack.default_threshold if threshold is None else threshold
        self._min_similarity = (
            model.config.min_similarity if min_similarity is None else min_similarity
        )

    @property
    def model(self) -> PairEncoder:
        return self._model

    @property
    def default_threshold(self) -> float:
        return self._threshold

    @property
    def min_similarity(self) -> float:
        return self._min_similarity

    def score(self, query: str, prompt: str, similarity: float) -> float:
        """Probability that ``prompt``'s answer is a correct answer to ``query``."""
        return self.score_many(query, [(prompt, similarity)])[0]

    def score_many(self, query: str, candidates: Sequence[tuple[str, float]]) -> list[float]:
        """:meth:`score` of each ``(prompt, similarity)``, the query encoded once."""
        out = [-1.0] * len(candidates)
        todo: list[int] = []
        for n, (prompt, _) in enumerate(candidates):
            ruled = rule_score(query, prompt)
            if ruled is None:
                todo.append(n)
            else:
                out[n] = ruled
        if todo:
            prompts = [candidates[n][0] for n in todo]
            tuned = self._model.cosines(query, prompts).tolist()
            scores = self._stack.score_many(query, list(zip(prompts, tuned, strict=True)))
            for n, p in zip(todo, scores, strict=True):
                out[n] = float(p)
        return out

    def score_triples(self, triples: Sequence[tuple[str, str, float]]) -> list[float]:
        """Scores of ``(query, prompt, similarity)`` triples of any queries, every
        distinct text encoded once in length-bucketed batches (a bench)."""
        texts = list(dict.fromkeys(t for q, p, _ in triples for t in (q, p)))
        vectors = np.zeros((len(texts), 0), dtype=np.float32)
        for start in range(0, len(texts), 256):
            part = self._model.embed(texts[start : start + 256])
            vectors = part if not start else np.concatenate([vectors, part])
        row = {t: i for i, t in enumerate(texts)}
        v = vectors.astype(np.float64)
        return [self._stack.score(q, p, float(np.dot(v[row[p]], v[row[q]])))
                for q, p, _ in triples]  # fmt: skip


def load_pair_encoder_verifier(directory: Path | None = None) -> PairEncoderVerifier:
    """The shipped pair encoder (or the export in ``directory``) as a verifier."""
    config, arrays = load_shipped(directory)
    return PairEncoderVerifier(PairEncoder(config, arrays))
