"""The semantic cache under a tenant error bound: real embedder, verifier, stores."""

from __future__ import annotations

import random

import pytest

from proxy.semantic.embedder import SentenceTransformerEmbedder
from proxy.semantic.redis_store import RedisStore
from proxy.semantic.service import SemanticCache, SemanticConfig
from proxy.semantic.store import EntryStore, InMemoryStore
from proxy.semantic.verifier import LogisticVerifier
from tests.proxy.semantic.semantic_helpers import answer, chat

pytestmark = pytest.mark.anyio

STORED = "How do I reset my password?"
PARAPHRASE = "How can I reset my password?"


def cache(
    embedder: SentenceTransformerEmbedder, verifier: LogisticVerifier, store: EntryStore,
    explore_rate: float = 0.0, seed: int = 0,
) -> SemanticCache:  # fmt: skip
    config = SemanticConfig(explore_rate=explore_rate)
    return SemanticCache(embedder, store, verifier, config, rng=random.Random(seed))


async def teach(c: SemanticCache, tenant: str, score: float, correct: bool, n: int) -> None:
    for _ in range(n):
        await c.evidence.observe(tenant, None, score, correct)


async def test_no_evidence_serves_only_exact_repeats_and_holds_back_the_rest(
    embedder: SentenceTransformerEmbedder, verifier: LogisticVerifier
) -> None:
    c = cache(embedder, verifier, InMemoryStore())
    entry_id = await c.store("t1", chat(STORED), answer("Click 'forgot'"))
    exact = await c.lookup_detailed("t1", chat(STORED), max_error_rate=0.02)
    assert exact.reason == "hit" and exact.hit is not None and exact.hit.score == 1.0
    near = await c.lookup_detailed("t1", chat(PARAPHRASE), max_error_rate=0.02)
    assert near.reason == "held_back" and near.hit is None
    assert near.probe is not None and near.probe.entry_id == entry_id
    assert near.probe.stored_texts == ("Click 'forgot'",) and near.probe.exact_compare
    # Without a bound the fixed threshold decides, as before.
    assert (await c.lookup("t1", chat(PARAPHRASE))) is not None
    # Evidence opens it: the engine's answer matched the stored one, many times over.
    probe = near.probe
    assert await c.evidence.check_probe("t1", probe, ("Click 'forgot'",))
    await teach(c, "t1", probe.score, True, 600)
    assert (await c.lookup_detailed("t1", chat(PARAPHRASE), max_error_rate=0.02)).reason == "hit"
    assert (await c.lookup_detailed("t2", chat(PARAPHRASE), max_error_rate=0.02)).hit is None
    # A wrong observation on the entry itself (a fresh answer that differs) shuts it again.
    assert not await c.evidence.check_probe("t1", probe, ("Something else",))
    assert (await c.lookup_detailed("t1", chat(PARAPHRASE), max_error_rate=0.02)).hit is None
    stats = c.stats.tenant("t1")
    assert stats.hits == 2 and stats.held_back >= 1 and stats.held_back_wrong == 1
    assert stats.max_error_rate == 0.02


async def test_exploration_answers_from_the_engine_and_measures_the_rate(
    embedder: SentenceTransformerEmbedder, verifier: LogisticVerifier
) -> None:
    c = cache(embedder, verifier, InMemoryStore(), explore_rate=1.0)
    await c.store("t1", chat(STORED), answer("Click 'forgot'"))
    near = await c.lookup_detailed("t1", chat(PARAPHRASE), max_error_rate=0.02)
    assert near.reason == "held_back"
    assert near.probe is not None
    await teach(c, "t1", near.probe.score, True, 600)
    explored = await c.lookup_detailed("t1", chat(PARAPHRASE), max_error_rate=0.02)
    assert explored.reason == "explore" and explored.hit is None
    assert explored.probe is not None and explored.probe.explored
    # Exact repeats are never explored.
    assert (await c.lookup_detailed("t1", chat(STORED), max_error_rate=0.02)).reason == "hit"
    assert await c.evidence.check_probe("t1", explored.probe, ("Click 'forgot'",))
    assert not await c.evidence.check_probe("t1", explored.probe, ("No idea",))
    stats = c.stats.tenant("t1")
    assert (stats.explored, stats.explored_checked, stats.explored_wrong) == (1, 2, 1)
    rate, low, high = stats.wrong_hit_rate()
    assert rate == 0.5 and low < 0.5 < high


async def test_a_sampled_answer_is_compared_by_the_verifier(
    embedder: SentenceTransformerEmbedder, verifier: LogisticVerifier
) -> None:
    c = cache(embedder, verifier, InMemoryStore())
    body = chat(STORED, temperature=0.7)
    await c.store("t1", body, answer("Open settings and choose reset password."),
                  allow_sampled=True)  # fmt: skip
    near = await c.lookup_detailed("t1", chat(PARAPHRASE, temperature=0.7), allow_sampled=True,
                                   max_error_rate=0.02)  # fmt: skip
    assert near.probe is not None and not near.probe.exact_compare
    same = ("Open settings and choose reset password",)
    assert await c.evidence.check_probe("t1", near.probe, same)
    assert not await c.evidence.check_probe("t1", near.probe, ("The capital of France is Paris.",))


async def test_feedback_adds_a_wrong_observation_and_invalidates(
    embedder: SentenceTransformerEmbedder, verifier: LogisticVerifier
) -> None:
    store = InMemoryStore()
    c = cache(embedder, verifier, store)
    entry_id = await c.store("t1", chat(STORED), answer("Click 'forgot'"))
    hit = await c.lookup("t1", chat(STORED), request_id="req-1", max_error_rate=0.02)
    assert hit is not None
    assert await c.invalidate("t1", request_id="req-1") == entry_id
    tenant, _ = await store.evidence("t1", [])
    assert tenant.num_wrong == 1 and tenant.wrong[-1] == 1
    assert c.stats.tenant("t1").feedback_wrong == 1
    assert await c.lookup("t1", chat(STORED), max_error_rate=0.02) is None


async def test_replicas_share_evidence_through_redis(
    redis_url: str, redis_prefix: str, embedder: SentenceTransformerEmbedder,
    verifier: LogisticVerifier,
) -> None:  # fmt: skip
    a = cache(embedder, verifier, RedisStore(redis_url, prefix=redis_prefix))
    b = cache(embedder, verifier, RedisStore(redis_url, prefix=redis_prefix))
    try:
        await a.load()
        await b.load()
        entry_id = await a.store("t1", chat(STORED), answer("Click 'forgot'"))
        assert await b.sync() == 1
        near = await b.lookup_detailed("t1", chat(PARAPHRASE), max_error_rate=0.02)
        assert near.reason == "held_back" and near.probe is not None
        await teach(a, "t1", near.probe.score, True, 600)  # learned on replica a
        served = await b.lookup_detailed("t1", chat(PARAPHRASE), max_error_rate=0.02,
                                         request_id="req-9")  # fmt: skip
        assert served.reason == "hit" and served.hit is not None
        await b.evidence.observe("t1", entry_id, near.probe.score, False)  # b sees a wrong one
        assert (await a.lookup_detailed("t1", chat(PARAPHRASE), max_error_rate=0.02)).hit is None
        # Feedback on a names the request b served: the score is read back from Redis.
        assert await a.invalidate("t1", request_id="req-9") == entry_id
        tenant, entries = await b._store.evidence("t1", [entry_id])
        assert tenant.num_wrong == 2 and tenant.num_correct == 600
        assert entries[0].num_wrong == 0  # the entry is gone, and its evidence with it
    finally:
        await a.aclose()
        await b.aclose()
