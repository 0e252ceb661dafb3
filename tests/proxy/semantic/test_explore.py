"""Which candidate the bound serves, explores or holds back (proxy.semantic.explore)."""

from __future__ import annotations

import random

import pytest

from proxy.semantic.bound import ErrorBound
from proxy.semantic.explore import BoundedChooser, answers_agree
from proxy.semantic.keys import PartitionKey
from proxy.semantic.mirror import Slot
from proxy.semantic.store import EntryId, InMemoryStore
from proxy.semantic.verifier import LogisticVerifier

pytestmark = pytest.mark.anyio


def slot(n: int) -> Slot:
    return Slot(EntryId(f"sem_{n:032x}"), "t", PartitionKey("p"), f"prompt {n}")


async def test_explores_about_the_configured_share_of_servable_hits() -> None:
    store = InMemoryStore()
    for _ in range(800):
        await store.observe("t", None, 0.9, True)
    chooser = BoundedChooser(store, ErrorBound(), 0.25, random.Random(7))
    outcomes = [await chooser.choose("t", [(0.9, 0.95, slot(1))], 0.5, 0.02) for _ in range(400)]
    explored = sum(c.explored for c in outcomes)
    assert all((c.serve is None) == c.explored for c in outcomes)
    assert 60 < explored < 140  # 25% of 400, seeded


async def test_holds_back_without_evidence_and_serves_once_a_lower_band_is_safe() -> None:
    store = InMemoryStore()
    chooser = BoundedChooser(store, ErrorBound(), 0.0, random.Random(0))
    candidates = [(0.8, 0.9, slot(1)), (0.7, 0.9, slot(2)), (0.4, 0.9, slot(3))]
    held = await chooser.choose("t", candidates, 0.5, 0.02)
    assert held.serve is None and held.probe == candidates[0] and not held.explored
    for _ in range(800):  # evidence at 0.7: safe from 0.7 up, so at 0.8 as well
        await store.observe("t", None, 0.7, True)
    served = await chooser.choose("t", candidates, 0.5, 0.02)
    assert served.serve == candidates[0] and served.probe is None
    assert served.decision is not None and served.decision.tenant_upper <= 0.02
    nothing = await chooser.choose("t", [(0.4, 0.9, slot(3))], 0.5, 0.02)
    assert nothing.serve is None and nothing.probe is None  # below the floor: no check


async def test_exact_repeat_is_served_without_evidence_or_exploring() -> None:
    chooser = BoundedChooser(InMemoryStore(), ErrorBound(), 1.0, random.Random(0))
    exact = await chooser.choose("t", [(1.0, 1.0, slot(1))], 0.5, 0.02)
    assert exact.serve is not None and not exact.explored


def test_bad_explore_rate() -> None:
    with pytest.raises(ValueError):
        BoundedChooser(InMemoryStore(), ErrorBound(), 1.5, random.Random(0))


def test_answers_agree(verifier: LogisticVerifier) -> None:
    assert answers_agree(("a b",), ("a b",), exact=True, verifier=verifier)
    assert not answers_agree(("a b",), ("a c",), exact=True, verifier=verifier)
    assert not answers_agree(("a", "b"), ("a",), exact=False, verifier=verifier)
    assert answers_agree(("same",), ("same",), exact=False, verifier=verifier)
