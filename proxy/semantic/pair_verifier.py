"""Second stage over the pair encoder's cosine (:mod:`proxy.semantic.pair_encoder`).

The pair encoder is the index's embedder, so the similarity the index hands over with
each candidate is the tuned cosine of the query's vector and the candidate's stored
vector: no model runs here. Candidates at or above ``min_similarity`` (a recall-first
floor on that cosine, fitted on the calib split) go with the pair's texts into a
:class:`proxy.semantic.verifier.LogisticVerifier` whose weights (the config's ``stack``)
were fitted on the calib split: the guard features catch what a pooled cosine misses
(swapped entities, negation, numbers). As the other verifiers do, an exact repeat
(case, spacing and final punctuation aside) scores 1 and a different arithmetic
operator scores 0.

``embedder`` names the embedder whose cosines the stack was fitted on
(:attr:`PairEncoder.name`); :func:`proxy.semantic.factory.build_semantic_cache` refuses
to pair this verifier with another embedder, whose cosines would mean something else.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from proxy.semantic.pair_encoder import PairEncoderConfig, load_shipped, weights_digest
from proxy.semantic.verifier import LogisticVerifier, VerifierWeights


class PairEncoderVerifier:
    """Guard features stacked on the pair encoder's cosine (see the module docstring)."""

    def __init__(
        self,
        config: PairEncoderConfig,
        embedder: str,
        *,
        threshold: float | None = None,
        min_similarity: float | None = None,
    ) -> None:
        self._config = config
        self._embedder = embedder
        self._stack = LogisticVerifier(VerifierWeights.from_json(config.stack))
        self._threshold = self._stack.default_threshold if threshold is None else threshold
        self._min_similarity = config.min_similarity if min_similarity is None else min_similarity

    @property
    def embedder(self) -> str:
        """The embedder whose cosines this verifier reads (``PairEncoder.name``)."""
        return self._embedder

    @property
    def default_threshold(self) -> float:
        return self._threshold

    @property
    def min_similarity(self) -> float:
        return self._min_similarity

    def score(self, query: str, prompt: str, similarity: float) -> float:
        """Probability that ``prompt``'s answer is a correct answer to ``query``, where
        ``similarity`` is the pair encoder's cosine of the two texts."""
        return self._stack.score(query, prompt, similarity)

    def score_many(self, query: str, candidates: Sequence[tuple[str, float]]) -> list[float]:
        """:meth:`score` of each ``(prompt, tuned cosine)``, the query parsed once."""
        return self._stack.score_many(query, candidates)


def load_pair_encoder_verifier(directory: Path | None = None) -> PairEncoderVerifier:
    """The verifier of the shipped pair encoder (or of the export in ``directory``)."""
    config, arrays = load_shipped(directory)
    return PairEncoderVerifier(config, f"kvtoll-pair-encoder/{weights_digest(arrays)}/int8-row")
