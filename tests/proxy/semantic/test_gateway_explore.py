"""Exploration through the gateway: a would-be hit answered by the upstream, billed as
the miss it is (real ledger), its answer compared with the stored one (real cache)."""

from __future__ import annotations

import asyncio
import random

import httpx
from sqlalchemy.orm import Session, sessionmaker

from billing.models import ServedBy
from kvtoll.settings import Settings
from proxy.semantic.embedder import SentenceTransformerEmbedder
from proxy.semantic.gateway import SemanticCacheAdapter
from proxy.semantic.service import SemanticCache, SemanticConfig
from proxy.semantic.store import InMemoryStore
from proxy.semantic.verifier import LogisticVerifier
from tests.proxy.helpers import (
    ADMIN,
    MODEL,
    LiveServer,
    Tenants,
    build_app,
    settled_rows,
    wait_until,
)
from tests.proxy.scripted import ScriptedUpstream


def _ask(server: LiveServer, key: str, text: str) -> httpx.Response:
    body = {"model": MODEL, "temperature": 0, "messages": [{"role": "user", "content": text}]}
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {key}"})  # fmt: skip


def test_explored_hit_is_billed_as_a_miss_and_checked(
    settings: Settings, db: sessionmaker[Session], tenants: Tenants,
    embedder: SentenceTransformerEmbedder, verifier: LogisticVerifier,
) -> None:  # fmt: skip
    cache = SemanticCache(embedder, InMemoryStore(), verifier, SemanticConfig(explore_rate=1.0),
                          rng=random.Random(0))  # fmt: skip
    upstream = ScriptedUpstream()
    app = build_app(settings, db, upstreams=[upstream], semantic=SemanticCacheAdapter(cache))
    tenant = str(tenants.tenant_a)
    with LiveServer(app) as server:
        first = _ask(server, tenants.key_a, "How do I reset my password?")
        assert first.headers["x-kvtoll-cache"] == "miss"
        wait_until(lambda: cache.num_mirrored(tenant) == 1, "the answer stored")
        held = _ask(server, tenants.key_a, "How can I reset my password?")
        assert held.headers["x-kvtoll-cache"] == "miss"  # no evidence yet: held back
        wait_until(lambda: cache.stats.tenant(tenant).held_back == 1, "the held-back check")
        wait_until(lambda: cache.num_mirrored(tenant) == 2, "the paraphrase stored")
        # The scripted upstream always answers alike, so the held-back check was right;
        # many more such checks, at every score above the floor, open paraphrases.
        evidence, _ = asyncio.run(cache._store.evidence(tenant, []))
        assert (evidence.num_correct, evidence.num_wrong) == (1, 0)
        for b in range(10, 20):
            for _ in range(600):
                asyncio.run(cache.evidence.observe(tenant, None, b / 20 + 0.01, True))
        explored = _ask(server, tenants.key_a, "How should I reset my password?")
        assert explored.headers["x-kvtoll-cache"] == "miss"
        fresh = explored.json()["choices"][0]["message"]["content"]
        assert fresh == "word0 word1 word2 word3 word4 "
        wait_until(lambda: cache.stats.tenant(tenant).explored_checked == 1,
                   f"the explored check {cache.stats.tenant(tenant)}")
        stats = cache.stats.tenant(tenant)
        assert stats.explored == 1 and stats.explored_wrong == 0 and stats.hits == 0
        repeat = _ask(server, tenants.key_a, "How do I reset my password?")
        assert repeat.headers["x-kvtoll-cache"] == "semantic"  # exact repeats: no exploring
        metrics = httpx.get(server.url + "/metrics", headers=ADMIN).text
    for line in ('kvtoll_semantic_tenant_hits_total{tenant="acme"} 1.0',
                 'kvtoll_semantic_explored_total{tenant="acme"} 1.0',
                 'kvtoll_semantic_explored_checked_total{tenant="acme"} 1.0',
                 'kvtoll_semantic_explored_wrong_total{tenant="acme"} 0.0',
                 'kvtoll_semantic_wrong_hit_rate{tenant="acme"} 0.0',
                 'kvtoll_semantic_max_error_rate{tenant="acme"} 0.02'):
        assert line in metrics, line
    high = next(x for x in metrics.splitlines()
                if x.startswith('kvtoll_semantic_wrong_hit_rate_high{tenant="acme"}'))
    assert 0.5 < float(high.split()[-1]) < 1.0  # one check: a wide 95% interval
    assert len(upstream.seen) == 3
    rows = settled_rows(db, 4)
    by_request = {r.request_id: r for r in rows}
    row = by_request[explored.headers["x-kvtoll-request-id"]]
    assert row.served_by is ServedBy.ENGINE and row.similarity is None
    assert row.billed_pico == row.list_pico > 0  # the full price, no semantic discount
    assert by_request[repeat.headers["x-kvtoll-request-id"]].served_by is ServedBy.SEMANTIC
