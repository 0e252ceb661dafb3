"""Aggregate usage queries: UTC buckets at boundaries, groups, layers (SQLite and PostgreSQL)."""

from __future__ import annotations

import uuid
from collections import Counter
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import text
from sqlalchemy.orm import Session, sessionmaker

from billing.accounts import create_tenant
from billing.ledger import LedgerEntry, write_usage_many
from billing.models import RequestStatus, ServedBy, TenantId
from billing.usage import BucketWidth, GroupBy, UsageQuery, aggregate_usage, total_usage

DAY = datetime(2026, 3, 10, tzinfo=UTC)
MOMENTS = [
    DAY - timedelta(microseconds=1),  # previous day, last instant
    DAY,
    DAY + timedelta(minutes=59, seconds=59),
    DAY + timedelta(hours=1),
    DAY + timedelta(hours=23, minutes=59, seconds=59, microseconds=999_999),
    DAY + timedelta(days=1),
]


def _entry(tenant_id: int, when: datetime, model: str, semantic: bool = False) -> LedgerEntry:
    return LedgerEntry(
        request_id=str(uuid.uuid4()), tenant_id=TenantId(tenant_id), api_key_id=None,
        model=model, served_by=ServedBy.SEMANTIC if semantic else ServedBy.ENGINE,
        status=RequestStatus.OK, prompt_tokens=100, cached_tokens=0 if semantic else 40,
        completion_tokens=10, similarity=None, worker=None, created_at=when,
    )


@pytest.fixture
def tenants(factory: sessionmaker[Session]) -> tuple[int, int]:
    with factory.begin() as session:
        first, second = create_tenant(session, "one").id, create_tenant(session, "two").id
    entries = [_entry(first, m, "a" if i % 2 else "b", semantic=i == 1)
               for i, m in enumerate(MOMENTS)]
    entries.append(_entry(second, DAY, "a"))
    write_usage_many(factory, entries)
    return first, second


def _expected(width: BucketWidth) -> Counter[datetime]:
    step = int(width.delta.total_seconds())
    return Counter(
        datetime.fromtimestamp(int(m.timestamp()) // step * step, UTC) for m in MOMENTS
    )


@pytest.mark.parametrize("width", list(BucketWidth))
def test_buckets_are_utc_aligned_whatever_the_session_time_zone(
    factory: sessionmaker[Session], tenants: tuple[int, int], width: BucketWidth
) -> None:
    query = UsageQuery(DAY - timedelta(days=2), DAY + timedelta(days=2), tenants[0], width=width)
    with factory() as session:
        if session.get_bind().dialect.name == "postgresql":
            session.execute(text("SET TIME ZONE 'Asia/Kolkata'"))  # +05:30 must not matter
        rows = aggregate_usage(session, query)
    assert Counter({r.bucket_start: r.totals.num_requests for r in rows}) == _expected(width)
    assert all(r.bucket_start is not None and r.bucket_start.tzinfo is not None for r in rows)


def test_groups_layers_and_scope(factory: sessionmaker[Session], tenants: tuple[int, int]) -> None:
    first, second = tenants
    window = (DAY - timedelta(days=2), DAY + timedelta(days=2))
    with factory() as session:
        by_model = aggregate_usage(session, UsageQuery(*window, first, group_by=(GroupBy.MODEL,)))
        by_tenant = aggregate_usage(session, UsageQuery(*window, None, group_by=(GroupBy.TENANT,)))
        totals = total_usage(session, UsageQuery(*window, first))
        empty = total_usage(session, UsageQuery(DAY + timedelta(days=5), DAY + timedelta(days=6),
                                                first))
    assert {(r.model, r.totals.num_requests) for r in by_model} == {("a", 3), ("b", 3)}
    assert {(r.tenant_id, r.totals.num_requests) for r in by_tenant} == {(first, 6), (second, 1)}
    assert totals.num_requests == 6 and totals.semantic_requests == 1
    assert totals.prompt_tokens == 600 and totals.cached_tokens == 5 * 40
    assert totals.semantic_tokens == 110
    assert totals.engine_cached_tokens == 200 and totals.engine_uncached_tokens == 5 * 60
    assert totals.engine_output_tokens == 50
    assert totals.prefix_hit_rate == pytest.approx(0.4)
    assert empty.num_requests == 0 and empty.billed_pico == 0


def test_end_is_exclusive_and_naive_times_are_refused() -> None:
    with pytest.raises(ValueError, match="aware"):
        UsageQuery(datetime(2026, 1, 1), datetime(2026, 2, 1, tzinfo=UTC), None)
    with pytest.raises(ValueError, match="before"):
        UsageQuery(datetime(2026, 2, 1, tzinfo=UTC), datetime(2026, 1, 1, tzinfo=UTC), None)
