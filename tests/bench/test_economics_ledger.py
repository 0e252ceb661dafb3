"""bench.economics.Ledger on the real PostgreSQL: the bench's database is created,
migrated and seeded, ledger rows written as the gateway writes them are read back with
their tenant and joined with the requests sent, and the database is dropped.

(The whole bench through ``kvtoll serve`` takes over a minute on this machine's CPUs,
most of it loading the models, so it is not a test: run ``bench/economics.py``.)"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import pytest
from sqlalchemy import create_engine, select, text

from bench.economics import TENANTS, Ledger
from bench.economics_accounting import SentRequest, join, summarize
from billing.db import make_engine, session_factory
from billing.ledger import LedgerEntry, write_usage
from billing.models import ApiKey, ApiKeyId, RequestStatus, ServedBy, Tenant, TenantId

pytestmark = pytest.mark.postgres
MODEL = "econ-test-model"


@pytest.fixture
def ledger(postgres_base_url: str) -> Ledger:
    return Ledger(postgres_base_url)


def _entry(tenant_id: int, key_id: str, served_by: ServedBy, prompt: int, cached: int,
           completion: int) -> LedgerEntry:
    return LedgerEntry(str(uuid.uuid4()), TenantId(tenant_id), ApiKeyId(key_id), MODEL,
                       served_by, RequestStatus.OK, prompt, cached, completion, None, None,
                       datetime.now(UTC))


def test_rows_come_back_with_their_tenant_and_join_the_requests(ledger: Ledger) -> None:
    keys = ledger.create(MODEL, ("1", "0.5", "4", "0.1"))
    try:
        assert set(keys) == set(TENANTS) and all(k.startswith("kvt_") for k in keys.values())
        engine = make_engine(ledger.url)
        factory = session_factory(engine)
        with factory() as s:
            ids = {t.name: t.id for t in s.scalars(select(Tenant))}
            key_of = {k.tenant_id: k.id for k in s.scalars(select(ApiKey))}
        p, q = ids[TENANTS["P"]], ids[TENANTS["Q"]]
        entries = [_entry(p, key_of[p], ServedBy.ENGINE, 40, 0, 4),
                   _entry(p, key_of[p], ServedBy.ENGINE, 40, 32, 4),
                   _entry(q, key_of[q], ServedBy.ENGINE, 20, 0, 10),
                   _entry(q, key_of[q], ServedBy.SEMANTIC, 22, 0, 10)]
        for entry in entries:
            assert write_usage(factory, entry)
        engine.dispose()

        rows = ledger.rows(expected=4, timeout_s=5)
        assert [(r.tenant, r.served_by, r.cached_tokens) for r in rows] == [
            ("P", "engine", 0), ("P", "engine", 32), ("Q", "engine", 0), ("Q", "semantic", 0)]
        # 1, 0.5 and 4 USD per 1M tokens: 1e6, 5e5 and 4e6 pico per token
        assert rows[1].billed_pico == 8 * 10**6 + 32 * 5 * 10**5 + 4 * 4 * 10**6
        totals = ledger.sql_totals()
        assert totals["Q"]["semantic_rows"] == 1 and totals["P"]["rows"] == 2
        assert totals["P"]["billed_pico"] == rows[0].billed_pico + rows[1].billed_pico

        prompt = tuple(range(40))
        sent = [SentRequest(e.request_id, t, pr, c, cache, "stop", "same answer")
                for e, t, pr, c, cache in zip(entries, "PPQQ", [prompt, prompt, (1,) * 20,
                                              (2,) * 22], ["a", "a", "x", "x"],
                                              ["miss", "miss", "miss", "semantic"], strict=True)]
        joined, missing = join(sent, rows, 16, ledger.price())
        assert not missing and len(joined) == 4
        out = summarize(joined)
        assert out["list_pico"] == sum(r.list_pico for r in rows)
        # P's repeat: 32 of 40 cached, as perfect caches would (but its answer was complete:
        # perfect caches serve it from the semantic cache); Q's paraphrase was a hit
        assert out["semantic_cacheable"] == 2 and out["semantic_cacheable_served"] == 1
        assert out["wrong_semantic_hits"] == 0
    finally:
        ledger.drop()
    admin = create_engine(ledger.base_url)
    with admin.connect() as conn:
        names = conn.execute(text("SELECT datname FROM pg_database")).scalars().all()
    admin.dispose()
    assert ledger.name not in names
