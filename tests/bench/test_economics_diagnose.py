"""bench.economics_diagnose with the real semantic cache (MiniLM embedder, shipped
verifier): an exact repeat of a completed answer replays as a hit, an unrelated question
as a miss, and a question whose only earlier ask was cut short finds nothing stored."""

from __future__ import annotations

import uuid

import pytest

from bench.economics_accounting import SentRequest, join
from bench.economics_diagnose import replay_semantic
from bench.economics_load import PlannedRequest
from billing.rating import PriceQuote
from tests.bench.test_economics_accounting import row

pytestmark = pytest.mark.slow
MODEL = "m"


def _pair(text: str, cls: str, cache: str, finish: str) -> tuple[PlannedRequest, SentRequest]:
    planned = PlannedRequest("Q", (("user", text),), cls, 16)
    return planned, SentRequest(str(uuid.uuid4()), "Q", (1, 2, 3), cls, cache, finish,
                                f"answer to {text}")


def test_replay_names_the_stage_and_agrees_with_the_gateway() -> None:
    pairs = [
        _pair("What is the capital of France?", "a", "miss", "stop"),
        _pair("What is the capital of France?", "a", "semantic", "stop"),
        _pair("How do tides form in the ocean?", "b", "miss", "length"),
        _pair("How do tides form in the ocean?", "b", "miss", "stop"),
    ]
    load = [p for p, _ in pairs]
    sent = [s for _, s in pairs]
    rows = [row(s, "semantic" if s.cache == "semantic" else "engine", 3, 0, 2, 70)
            for s in sent]
    joined, _ = join(sent, rows, 16, PriceQuote(10, 4, 20, 100_000))
    reasons, summary = replay_semantic(load, sent, joined, MODEL)
    assert [reasons[s.request_id] for s in sent] == ["miss", "hit", "miss", "miss"]
    assert summary["replay_agrees_with_gateway"] == 4
    assert summary["cacheable_missed_by_reason"] == {}
