"""The count-validated bucket cache answers exactly what a fresh aggregate answers."""

from __future__ import annotations

import random
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy.orm import Session, sessionmaker

import billing.usage_cache as usage_cache_module
from billing.accounts import create_tenant
from billing.ledger import LedgerEntry, write_usage_many
from billing.models import RequestStatus, ServedBy, TenantId
from billing.usage import BucketWidth, GroupBy, UsageQuery, aggregate_usage
from billing.usage_cache import UsageCache

START = datetime(2026, 4, 1, tzinfo=UTC)


def _entries(tenant_id: int, rng: random.Random, count: int, days: int) -> list[LedgerEntry]:
    return [
        LedgerEntry(
            request_id=str(uuid.uuid4()), tenant_id=TenantId(tenant_id), api_key_id=None,
            model=rng.choice(["a", "b"]),
            served_by=ServedBy.SEMANTIC if rng.random() < 0.3 else ServedBy.ENGINE,
            status=RequestStatus.OK, prompt_tokens=50, cached_tokens=rng.randint(0, 50),
            completion_tokens=rng.randint(0, 9), similarity=None, worker=None,
            created_at=START + timedelta(seconds=rng.randrange(days * 86400)),
        )
        for _ in range(count)
    ]


@pytest.fixture
def tenant_id(factory: sessionmaker[Session]) -> int:
    with factory.begin() as session:
        tid = create_tenant(session, "cached").id
        other = create_tenant(session, "other").id
    rng = random.Random(5)
    write_usage_many(factory, _entries(tid, rng, 120, 6) + _entries(other, rng, 40, 6))
    return tid


def _same(factory: sessionmaker[Session], cache: UsageCache, query: UsageQuery) -> None:
    with factory() as session:
        expected = aggregate_usage(session, query)
    with factory() as session:
        got = cache.aggregate(session, query)
    key = lambda r: (r.bucket_start, r.tenant_id or 0, r.model or "")  # noqa: E731
    assert sorted(got, key=key) == sorted(expected, key=key)


@pytest.mark.parametrize("width", list(BucketWidth))
def test_matches_a_fresh_aggregate_and_sees_late_rows(
    factory: sessionmaker[Session], tenant_id: int, width: BucketWidth
) -> None:
    cache = UsageCache()
    ranges = [
        (START, START + timedelta(days=6)),
        (START + timedelta(hours=5, minutes=17), START + timedelta(days=4, seconds=3)),
        (START + timedelta(minutes=1), START + timedelta(minutes=50)),
    ]
    for group_by in ((), (GroupBy.MODEL,)):
        for start, end in ranges:
            query = UsageQuery(start, end, tenant_id, width=width, group_by=group_by)
            _same(factory, cache, query)
            _same(factory, cache, query)  # served from the cache now
    for group_by in ((), (GroupBy.TENANT,), (GroupBy.TENANT, GroupBy.MODEL)):
        across = UsageQuery(START, START + timedelta(days=5, hours=3), None, width=width,
                            group_by=group_by)
        _same(factory, cache, across)
        _same(factory, cache, across)
    late = _entries(tenant_id, random.Random(9), 3, 2)
    write_usage_many(factory, late)
    _same(factory, cache, UsageQuery(START, START + timedelta(days=6), tenant_id, width=width))
    _same(factory, cache, UsageQuery(START, START + timedelta(days=6), None, width=width))


def test_unchanged_buckets_are_not_aggregated_again(
    factory: sessionmaker[Session], tenant_id: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[UsageQuery] = []

    def spy(session: Session, query: UsageQuery) -> list:
        calls.append(query)
        return aggregate_usage(session, query)

    monkeypatch.setattr(usage_cache_module, "aggregate_usage", spy)
    cache = UsageCache()
    query = UsageQuery(START, START + timedelta(days=6), tenant_id, width=BucketWidth.DAY)
    with factory() as session:
        first = cache.aggregate(session, query)
    with factory() as session:
        dialect = session.get_bind().dialect.name
        calls.clear()
        assert cache.aggregate(session, query) == first
    if dialect != "postgresql":
        assert len(calls) == 1  # SQLite: no cache, one plain aggregate
        return
    assert calls == []
    write_usage_many(factory, _entries(tenant_id, random.Random(3), 1, 1))  # lands on day 1
    with factory() as session:
        cache.aggregate(session, query)
    assert [(q.start, q.end) for q in calls] == [(START, START + timedelta(days=1))]


def test_eviction_keeps_answers_exact(factory: sessionmaker[Session], tenant_id: int) -> None:
    cache = UsageCache(max_entries=2)
    for _ in range(2):
        _same(factory, cache, UsageQuery(START, START + timedelta(days=6), tenant_id,
                                         width=BucketWidth.DAY))
    with pytest.raises(ValueError):
        UsageCache(max_entries=0)
