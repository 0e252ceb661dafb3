"""Serve a semantic hit only where evidence bounds its wrong-hit rate (after vCache).

vCache (ICLR 2026) keeps, per cache entry, the similarity scores at which answering a
neighbour from that entry was right or wrong, fits a per-entry model of P(correct |
score) and serves only where the model's confidence bound meets the operator's error
target. Per-entry evidence alone is thin (an entry is reused a handful of times), so
this module shares strength between an entry and its tenant with a simpler rule whose
parts are each standard: a Wilson bound over the tenant's pooled evidence and a Beta
shrinkage of the entry's own evidence toward that bound.

Evidence
--------
An observation is (bin of the verifier score at which an entry answered, or would have
answered, a query; correct or not). Scores in [0, 1] fall into ``NUM_BINS`` bins of
width 0.05 (a score of 1.0 in the top bin). Each entry counts its own observations;
its tenant counts the sum over all its entries (kept when an entry goes). Observations
come from exploration (a would-be hit also answered by the engine, the two answers
compared) and from client feedback (a reported wrong hit is a wrong observation).

Rule: serve entry ``e`` at score ``s`` (bin ``b``) for a tenant with bound ``delta`` iff
---------------------------------------------------------------------------------------
1. ``s >= 1``: the verifier gives 1 only to an exact repeat of the stored prompt
   (case, spacing, final punctuation aside), whose stored answer is an answer to it by
   construction; exact repeats are served and never counted as evidence, or
2. ``post(e, s) <= delta`` where

   * ``mu(s)``: the Wilson upper bound (``z``, 1.96 = 95% two-sided) of the error rate of
     the tenant's observations at bins ``>= b`` plus, in each of those bins ``c``,
     ``prior_weight`` pseudo-observations at error ``1 - c/NUM_BINS`` (the verifier is
     calibrated: its score estimates P(correct); the bin's lower edge is the cautious
     reading). Pooling scores ``>= s`` bounds the error of what serving from ``s``
     upward would serve (exploration samples the would-be hits at those scores); the
     per-bin prior keeps evidence high up from opening a band never observed. Error
     falls as the score rises, so ``mu(s)`` is the lowest such bound over the bins at
     or below ``b``: where serving from a lower score is safe, a higher one is too.
   * ``post(e, s) = (kappa * mu(s) + w_e) / (kappa + n_e)``: the posterior mean of the
     entry's error under a Beta prior of strength ``kappa`` centred on ``mu(s)``, where
     ``w_e`` counts the entry's wrong observations at any score and ``n_e = w_e +`` its
     correct observations at bins ``<= b`` (right at a lower score supports a higher one;
     one wrong anywhere weighs against every score).

Consequences: with no evidence nothing but exact repeats is served (the prior alone
gives ``mu`` near 0.5); a new entry in a tenant with good evidence at ``s`` is served
there (``post = mu``); an entry seen right many times is served below the tenant's
reach; one wrong observation on an entry stops it until about ``1/delta`` right ones
outweigh it. Adding a correct observation never raises ``post``, adding a wrong one
never lowers it, and a higher score never turns a serve into a refusal
(tests/proxy/semantic/test_bound.py).

Parameters (:class:`BoundConfig`): ``z`` (1.96), ``prior_weight`` (4 pseudo-observations),
``kappa`` (10).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

NUM_BINS = 20
DEFAULT_MAX_ERROR_RATE = 0.02


def score_bin(score: float) -> int:
    """The evidence bin of a verifier score (scores outside [0, 1] are clamped)."""
    return min(NUM_BINS - 1, max(0, math.floor(float(score) * NUM_BINS)))


def is_exact(score: float) -> bool:
    """The verifier's score of an exact repeat."""
    return score >= 1.0


@dataclass(frozen=True)
class Evidence:
    """Correct and wrong observations per score bin (``NUM_BINS`` each)."""

    correct: tuple[int, ...] = (0,) * NUM_BINS
    wrong: tuple[int, ...] = (0,) * NUM_BINS

    def __post_init__(self) -> None:
        if len(self.correct) != NUM_BINS or len(self.wrong) != NUM_BINS:
            raise ValueError(f"evidence needs {NUM_BINS} bins")
        if min(self.correct) < 0 or min(self.wrong) < 0:
            raise ValueError("evidence counts must be >= 0")

    @staticmethod
    def of(observations: Sequence[tuple[float, bool]]) -> Evidence:
        """Evidence of ``(score, correct)`` observations."""
        correct, wrong = [0] * NUM_BINS, [0] * NUM_BINS
        for score, ok in observations:
            (correct if ok else wrong)[score_bin(score)] += 1
        return Evidence(tuple(correct), tuple(wrong))

    def add(self, score: float, correct: bool) -> Evidence:
        """This evidence plus one observation."""
        b = score_bin(score)
        if correct:
            return Evidence(_bump(self.correct, b), self.wrong)
        return Evidence(self.correct, _bump(self.wrong, b))

    def plus(self, other: Evidence) -> Evidence:
        """The bin-wise sum of two evidence counts."""
        return Evidence(
            tuple(a + b for a, b in zip(self.correct, other.correct, strict=True)),
            tuple(a + b for a, b in zip(self.wrong, other.wrong, strict=True)),
        )

    @property
    def num_correct(self) -> int:
        return sum(self.correct)

    @property
    def num_wrong(self) -> int:
        return sum(self.wrong)

    def at_or_above(self, b: int) -> tuple[int, int]:
        """(observations, wrong ones) at bins ``>= b``."""
        wrong = sum(self.wrong[b:])
        return sum(self.correct[b:]) + wrong, wrong


def _bump(counts: tuple[int, ...], b: int) -> tuple[int, ...]:
    return (*counts[:b], counts[b] + 1, *counts[b + 1 :])


def wilson_interval(wrong: float, total: float, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval of a rate ``wrong / total`` (``(0, 1)`` with no data)."""
    if total <= 0:
        return 0.0, 1.0
    p = min(1.0, max(0.0, wrong / total))
    z2 = z * z
    centre = (p + z2 / (2 * total)) / (1 + z2 / total)
    half = z * math.sqrt(p * (1 - p) / total + z2 / (4 * total * total)) / (1 + z2 / total)
    return max(0.0, centre - half), min(1.0, centre + half)


@dataclass(frozen=True)
class BoundConfig:
    """Parameters of the rule (module docstring)."""

    z: float = 1.96
    prior_weight: float = 4.0
    kappa: float = 10.0

    def __post_init__(self) -> None:
        if self.z <= 0 or self.prior_weight < 0 or self.kappa <= 0:
            raise ValueError("z and kappa must be > 0 and prior_weight >= 0")


@dataclass(frozen=True)
class Decision:
    """Whether to serve, and the figures that decided it."""

    serve: bool
    tenant_upper: float  # mu(s); 0 for an exact repeat
    entry_error: float  # post(e, s); 0 for an exact repeat


class ErrorBound:
    """The serving rule of the module docstring."""

    def __init__(self, config: BoundConfig | None = None) -> None:
        self._config = config or BoundConfig()

    @property
    def config(self) -> BoundConfig:
        return self._config

    def tenant_upper(self, tenant: Evidence, score: float) -> float:
        """``mu(s)``: the bound of the tenant's error from ``score`` upward (the lowest
        of the bounds from each bin at or below ``score``'s: monotone in the score)."""
        return min(self._upper_from(tenant, b) for b in range(score_bin(score) + 1))

    def _upper_from(self, tenant: Evidence, b: int) -> float:
        total, wrong = tenant.at_or_above(b)
        k = self._config.prior_weight
        prior_wrong = k * sum(1.0 - c / NUM_BINS for c in range(b, NUM_BINS))
        prior_total = k * (NUM_BINS - b)
        return wilson_interval(wrong + prior_wrong, total + prior_total, self._config.z)[1]

    def entry_error(self, entry: Evidence, mu: float, score: float) -> float:
        """``post(e, s)``: the entry's error at ``score``, shrunk toward ``mu``."""
        b = score_bin(score)
        wrong = entry.num_wrong
        n = wrong + sum(entry.correct[: b + 1])
        kappa = self._config.kappa
        return (kappa * mu + wrong) / (kappa + n)

    def decide(
        self, score: float, max_error_rate: float, entry: Evidence, tenant: Evidence
    ) -> Decision:
        """Serve entry (with evidence ``entry``) at ``score`` under ``max_error_rate``?"""
        if not 0.0 < max_error_rate < 1.0:
            raise ValueError(f"max_error_rate must be in (0, 1), got {max_error_rate}")
        if is_exact(score):
            return Decision(True, 0.0, 0.0)
        mu = self.tenant_upper(tenant, score)
        post = self.entry_error(entry, mu, score)
        return Decision(post <= max_error_rate, mu, post)
