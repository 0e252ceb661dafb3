"""Calibrated decision: is a cached prompt a correct stand-in for the query?

Three verifiers implement :class:`Verifier`: the pair encoder's
(:mod:`proxy.semantic.pair_verifier`, the default where its weights ship: a fine-tuned
encoder's cosine with this module's guard features stacked on it),
:class:`CrossEncoderVerifier` (see its docstring: a cross-encoder re-scores the index's
candidates) and :class:`LogisticVerifier` (guard features, no second model), described here.

Policy (logistic)
-----------------
score = sigmoid(w · standardise(features(sim, query, prompt)) + b), a logistic
regression over the guard features of :mod:`proxy.semantic.features`. The weights
ship in ``data/verifier_weights.json`` (trained by ``bench/semantic_train.py`` on the
training split of the QQP pairs plus the training half of the hand-written hard
cases in ``bench/semantic/hard_cases.jsonl``; no training data ships). A candidate is served
only if ``score >= threshold``. The default threshold in the weights file is the lowest
whose precision on the calib split's labelled pairs is >= 0.95; QQP's own labels put
the cache's precision below that at this recall (``bench/semantic_cv.py`` prints the
curve), so a tenant that wants fewer, surer hits raises its own threshold
(``Tenant.semantic_threshold``).
Candidates below ``min_similarity`` are rejected without scoring; a prompt with the
same words as the query (case and punctuation aside) scores 1 (an exact repeat).

Cost: a lookup scores its few candidates in one call (:meth:`LogisticVerifier.score_many`):
the query is parsed once, cached prompts' parses are kept in a bounded LRU
(``parse_cache_size``; a hit's candidates are the popular prompts), and the linear
model runs as one matrix product.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from proxy.semantic.cross_encoder import CrossEncoder, Precision, load_shipped
from proxy.semantic.features import FEATURE_NAMES, Parsed, build_lexicon, features, parse

WEIGHTS_FILE = "verifier_weights.json"


class Verifier(Protocol):
    """Scores a (query, cached prompt, similarity) triple in [0, 1]."""

    @property
    def default_threshold(self) -> float: ...

    @property
    def min_similarity(self) -> float: ...

    def score(self, query: str, prompt: str, similarity: float) -> float: ...

    def score_many(self, query: str, candidates: Sequence[tuple[str, float]]) -> list[float]:
        """Scores of ``(prompt, similarity)`` candidates for one query, in order."""
        ...


def check_pairing(embedder: str, verifier: Verifier) -> None:
    """ValueError when ``verifier`` reads another embedder's cosines (its ``embedder``
    attribute, where it has one) than those of the embedder named ``embedder``."""
    expected = getattr(verifier, "embedder", None)
    if expected is not None and expected != embedder:
        raise ValueError(f"the verifier reads {expected}'s cosines; the embedder is {embedder}")


@dataclass(frozen=True)
class VerifierWeights:
    """Logistic-regression weights over standardised features."""

    feature_names: tuple[str, ...]
    coef: tuple[float, ...]
    intercept: float
    mean: tuple[float, ...]
    scale: tuple[float, ...]
    threshold: float
    min_similarity: float
    embedder: str
    meta: dict[str, Any]

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> VerifierWeights:
        names = tuple(data["feature_names"])
        if names != FEATURE_NAMES:
            raise ValueError(
                f"weights are for features {names}, this code computes {FEATURE_NAMES}"
            )
        return cls(
            feature_names=names,
            coef=tuple(float(x) for x in data["coef"]),
            intercept=float(data["intercept"]),
            mean=tuple(float(x) for x in data["mean"]),
            scale=tuple(float(x) for x in data["scale"]),
            threshold=float(data["threshold"]),
            min_similarity=float(data.get("min_similarity", 0.5)),
            embedder=str(data.get("embedder", "")),
            meta=dict(data.get("meta", {})),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "feature_names": list(self.feature_names),
            "coef": list(self.coef),
            "intercept": self.intercept,
            "mean": list(self.mean),
            "scale": list(self.scale),
            "threshold": self.threshold,
            "min_similarity": self.min_similarity,
            "embedder": self.embedder,
            "meta": self.meta,
        }


def load_weights(path: str | Path | None = None) -> VerifierWeights:
    """The shipped weights, or those in ``path``."""
    if path is None:
        text = resources.files("proxy.semantic.data").joinpath(WEIGHTS_FILE).read_text()
    else:
        text = Path(path).read_text()
    return VerifierWeights.from_json(json.loads(text))


class LogisticVerifier:
    """Guard features + logistic regression (see the module docstring)."""

    def __init__(self, weights: VerifierWeights, parse_cache_size: int = 4096) -> None:
        if parse_cache_size < 0:
            raise ValueError("parse_cache_size must be >= 0")
        self._weights = weights
        self._lexicon = build_lexicon()
        self._coef = np.asarray(weights.coef, dtype=np.float64)
        self._mean = np.asarray(weights.mean, dtype=np.float64)
        self._scale = np.asarray(weights.scale, dtype=np.float64)
        self._parsed: OrderedDict[str, Parsed] = OrderedDict()
        self._parse_cache_size = parse_cache_size

    @property
    def weights(self) -> VerifierWeights:
        return self._weights

    @property
    def default_threshold(self) -> float:
        return self._weights.threshold

    @property
    def min_similarity(self) -> float:
        return self._weights.min_similarity

    def parse(self, text: str) -> Parsed:
        """``text`` parsed, from the LRU when it was parsed recently."""
        found = self._parsed.get(text)
        if found is not None:
            self._parsed.move_to_end(text)
            return found
        parsed = parse(text, self._lexicon)
        if self._parse_cache_size:
            self._parsed[text] = parsed
            if len(self._parsed) > self._parse_cache_size:
                self._parsed.popitem(last=False)
        return parsed

    def feature_vector(self, query: str, prompt: str, similarity: float) -> list[float]:
        """Raw (unstandardised) features of one pair."""
        return features(similarity, self.parse(query), self.parse(prompt), self._lexicon)

    def score(self, query: str, prompt: str, similarity: float) -> float:
        """Probability that ``prompt``'s answer is a correct answer to ``query``."""
        return self.score_many(query, [(prompt, similarity)])[0]

    def score_many(self, query: str, candidates: Sequence[tuple[str, float]]) -> list[float]:
        """:meth:`score` of each ``(prompt, similarity)``, the query parsed once."""
        out = [-1.0] * len(candidates)
        rows: list[list[float]] = []
        slots: list[int] = []
        operators, normalised = _operators(query), _normalised(query)
        parsed_query: Parsed | None = None
        for n, (prompt, similarity) in enumerate(candidates):
            if _operators(prompt) != operators:
                out[n] = 0.0  # 10 - 4 vs 10 + 4, x < y vs x > y: the words alone cannot tell
            elif normalised and _normalised(prompt) == normalised:
                out[n] = 1.0  # an exact repeat (case, spacing and final punctuation aside)
            else:
                parsed_query = parsed_query or self.parse(query)
                rows.append(features(similarity, parsed_query, self.parse(prompt), self._lexicon))
                slots.append(n)
        if rows:
            z = ((np.asarray(rows) - self._mean) / self._scale) @ self._coef
            probs = 1.0 / (1.0 + np.exp(-np.clip(z + self._weights.intercept, -60.0, 60.0)))
            for n, p in zip(slots, probs.tolist(), strict=True):
                out[n] = p
        return out


class CrossEncoderVerifier:
    """Second stage: a cross-encoder re-scores the embedding index's candidates.

    The index's top-k candidates at or above ``min_similarity`` (a recall-first cosine
    floor fitted on the calib split) are scored by reading query and cached prompt
    together (:class:`proxy.semantic.cross_encoder.CrossEncoder`): one forward pass per
    length bucket for all candidates of a query. The score is the Platt-calibrated
    probability that the two are the same question; the default threshold was chosen on
    the calib split. As in :class:`LogisticVerifier`, an exact repeat (case, spacing and
    final punctuation aside) scores 1 and a different arithmetic operator scores 0,
    without running the model. The similarity does not enter the score.
    """

    runs_model = True  # the service runs it on the embedder's worker pool

    def __init__(
        self,
        model: CrossEncoder,
        *,
        threshold: float | None = None,
        min_similarity: float | None = None,
        max_candidates: int | None = None,
    ) -> None:
        if max_candidates is not None and max_candidates < 1:
            raise ValueError("max_candidates must be >= 1")
        self._model = model
        self._max_candidates = max_candidates
        self._threshold = model.config.threshold if threshold is None else threshold
        self._min_similarity = (
            model.config.min_similarity if min_similarity is None else min_similarity
        )

    @property
    def model(self) -> CrossEncoder:
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
        """:meth:`score` of each ``(prompt, similarity)``, the model run once. With
        ``max_candidates``, only that many of the most similar are read (the rest
        score 0, unless an exact repeat): the cost of a lookup stays bounded."""
        chosen: list[int] = list(range(len(candidates)))
        if self._max_candidates is not None and len(candidates) > self._max_candidates:
            by_similarity = sorted(chosen, key=lambda n: -candidates[n][1])
            chosen = sorted(by_similarity[: self._max_candidates])
        out = [1.0 if exact_repeat(query, prompt) else 0.0 for prompt, _ in candidates]
        scores = self.score_pairs([(query, candidates[n][0]) for n in chosen])
        for n, score in zip(chosen, scores, strict=True):
            out[n] = score
        return out

    def score_pairs(self, pairs: Sequence[tuple[str, str]]) -> list[float]:
        """Scores of ``(query, prompt)`` pairs of any queries, batched together (a bench,
        or a caller comparing answers with answers)."""
        out = [-1.0] * len(pairs)
        todo: list[int] = []
        for n, (query, prompt) in enumerate(pairs):
            ruled = rule_score(query, prompt)
            if ruled is None:
                todo.append(n)
            else:
                out[n] = ruled
        if todo:
            probs = self._model.probabilities([pairs[n] for n in todo])
            for n, p in zip(todo, probs.tolist(), strict=True):
                out[n] = float(p)
        return out


def rule_score(query: str, prompt: str) -> float | None:
    """What the rules decide without a model: 0 where the arithmetic operators differ,
    1 for an exact repeat; None where a model must read the pair."""
    if _operators(prompt) != _operators(query):
        return 0.0  # 10 - 4 vs 10 + 4, x < y vs x > y
    if exact_repeat(query, prompt):
        return 1.0
    return None


def load_cross_encoder_verifier(
    directory: Path | None = None, *, precision: Precision = "int8",
    max_candidates: int | None = None,
) -> CrossEncoderVerifier:  # fmt: skip
    """The shipped cross-encoder (or the export in ``directory``) as a verifier;
    ``max_candidates`` defaults to the export's (``meta.max_candidates``, else no cap)."""
    config, arrays = load_shipped(directory)
    if max_candidates is None and config.meta.get("max_candidates") is not None:
        max_candidates = int(config.meta["max_candidates"])
    return CrossEncoderVerifier(
        CrossEncoder(config, arrays, precision=precision), max_candidates=max_candidates
    )


# Arithmetic and comparison symbols that are not part of a word ("e-mail" keeps its hyphen).
_OPERATOR = re.compile(r"(?<![A-Za-z])[-+*/^<>=\u00b2\u00b3]")


def _operators(text: str) -> list[str]:
    return sorted(_OPERATOR.findall(text))


def exact_repeat(query: str, prompt: str) -> bool:
    """Whether ``prompt`` repeats ``query`` (case, spacing and final punctuation aside)."""
    normalised = _normalised(query)
    return bool(normalised) and _normalised(prompt) == normalised


def _normalised(text: str) -> str:
    return " ".join(text.casefold().split()).rstrip("?.! ")
