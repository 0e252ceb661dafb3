"""Which verified candidate to serve under a tenant's error bound, which to re-check.

Policy
------
Candidates come scored by the verifier, best first. Those below the *floor* (the
tenant's ``semantic_threshold`` when set, else ``SemanticConfig.bound_floor``, a
recall-first score) are never hits. For the rest, best first, the error bound
(:mod:`proxy.semantic.bound`) decides from the store's evidence:

* the first candidate the bound serves is the hit, except that with probability
  ``explore_rate`` (never for an exact repeat, right by construction) the hit is
  *explored*: the gateway answers from the engine instead (billed as the miss it is),
  compares the fresh answer with the stored one and records the outcome;
* when the bound serves none, the best candidate is *held back*: the request goes to
  the engine anyway, so comparing the answers is free evidence at that score.

Comparing answers (:func:`answers_agree`): every choice's text equal, for a
temperature-0 request (deterministic); otherwise the verifier's ``score_many`` on the
two answers (with their embeddings' cosine) at or above its default threshold.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from proxy.semantic.bound import Decision, ErrorBound, is_exact
from proxy.semantic.mirror import Slot
from proxy.semantic.store import EntryId, EntryStore
from proxy.semantic.verifier import Verifier

Scored = tuple[float, float, Slot]  # (verifier score, cosine similarity, slot)


@dataclass(frozen=True)
class Choice:
    """``serve``: the candidate to answer from (None: none); ``probe``: the candidate
    whose stored answer the engine's fresh one is compared with (None: no check);
    ``explored``: the probe is a hit the bound would have served."""

    serve: Scored | None
    probe: Scored | None
    explored: bool
    decision: Decision | None


class BoundedChooser:
    """Applies the policy of the module docstring."""

    def __init__(
        self, store: EntryStore, bound: ErrorBound, explore_rate: float, rng: random.Random
    ) -> None:
        if not 0.0 <= explore_rate <= 1.0:
            raise ValueError(f"explore_rate must be in [0, 1], got {explore_rate}")
        self._store = store
        self._bound = bound
        self._explore_rate = explore_rate
        self._rng = rng

    async def choose(
        self, tenant_id: str, scored: Sequence[Scored], floor: float, max_error_rate: float
    ) -> Choice:
        eligible = [c for c in scored if c[0] >= floor]
        if not eligible:
            return Choice(None, None, False, None)
        ids = [EntryId(c[2].entry_id) for c in eligible if not is_exact(c[0])]
        tenant, entries = await self._store.evidence(tenant_id, ids) if ids else (None, [])
        by_id = dict(zip(ids, entries, strict=True))
        decision: Decision | None = None
        for candidate in eligible:
            score = candidate[0]
            if is_exact(score):
                return Choice(candidate, None, False, None)
            assert tenant is not None
            decision = self._bound.decide(
                score, max_error_rate, by_id[EntryId(candidate[2].entry_id)], tenant
            )
            if decision.serve:
                if self._rng.random() < self._explore_rate:
                    return Choice(None, candidate, True, decision)
                return Choice(candidate, None, False, decision)
        return Choice(None, eligible[0], False, decision)


def answers_agree(
    stored: Sequence[str],
    fresh: Sequence[str],
    *,
    exact: bool,
    verifier: Verifier,
    similarities: Sequence[float] | None = None,
) -> bool:
    """Whether a fresh answer confirms the stored one (module docstring)."""
    if len(stored) != len(fresh):
        return False
    if exact or all(a == b for a, b in zip(stored, fresh, strict=True)):
        return all(a == b for a, b in zip(stored, fresh, strict=True))
    sims = similarities or [1.0] * len(stored)
    threshold = verifier.default_threshold
    return all(
        verifier.score_many(a, [(b, float(sim))])[0] >= threshold
        for a, b, sim in zip(stored, fresh, sims, strict=True)
    )


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    """Cosine of two vectors (0 for a zero vector)."""
    norm = float(np.linalg.norm(a) * np.linalg.norm(b))
    return float(np.dot(a, b) / norm) if norm else 0.0
