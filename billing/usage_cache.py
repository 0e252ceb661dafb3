"""Exact per-bucket cache of usage aggregates, validated by row counts.

Algorithm (PostgreSQL, bucketed queries; anything else goes straight to
:func:`billing.usage.aggregate_usage`; a query across tenants is answered as the
sum of every tenant's own cached answer):

1. Split the range into whole buckets and at most two partial edge buckets.
2. Count the rows of every whole bucket in one query (an index-only scan of
   ``(tenant_id, created_at)`` where the visibility map allows: ~4x cheaper than
   aggregating the rows).
3. A cached bucket whose stored row count equals the current count is reused;
   the others (and the edges) are aggregated again, one query per run of
   consecutive buckets, and stored with the row count *of that aggregate*.

Exactness rests on the ledger being append-only: rows are never deleted and
their usage columns never change (only ``invoice_id`` is set, once). A bucket's
rows therefore only ever grow, so an unchanged count means an unchanged set of
rows. A row that lands between the count and the aggregate is included by the
aggregate and changes the count, so the next call aggregates that bucket again.

Parameters: ``max_entries`` buckets are kept, least recently used evicted first.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from billing.models import Tenant
from billing.usage import (
    GroupBy,
    UsageQuery,
    UsageRow,
    aggregate_usage,
    bucket_floor,
    bucket_row_counts,
    supports_bucket_counts,
)

DEFAULT_MAX_ENTRIES = 50_000
_CacheKey = tuple[int, str, tuple[GroupBy, ...], datetime]


@dataclass(frozen=True)
class _Entry:
    num_rows: int
    rows: tuple[UsageRow, ...]


def _runs(starts: Sequence[datetime], query: UsageQuery) -> list[tuple[datetime, datetime]]:
    """Consecutive bucket starts merged into ``[start, end)`` ranges."""
    assert query.width is not None
    step = query.width.delta
    runs: list[tuple[datetime, datetime]] = []
    for start in sorted(starts):
        if runs and runs[-1][1] == start:
            runs[-1] = (runs[-1][0], start + step)
        else:
            runs.append((start, start + step))
    return runs


class UsageCache:
    """Thread-safe LRU of whole-bucket aggregates (see the module algorithm)."""

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        if max_entries <= 0:
            raise ValueError("max_entries must be positive")
        self._max_entries = max_entries
        self._entries: OrderedDict[_CacheKey, _Entry] = OrderedDict()
        self._lock = threading.Lock()

    def _key(self, query: UsageQuery, start: datetime) -> _CacheKey:
        assert query.tenant_id is not None and query.width is not None
        return (query.tenant_id, query.width.value, query.group_by, start)

    def _lookup(self, key: _CacheKey, num_rows: int) -> _Entry | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.num_rows != num_rows:
                return None
            self._entries.move_to_end(key)
            return entry

    def _store(self, key: _CacheKey, entry: _Entry) -> None:
        with self._lock:
            self._entries[key] = entry
            self._entries.move_to_end(key)
            while len(self._entries) > self._max_entries:
                self._entries.popitem(last=False)

    def aggregate(self, session: Session, query: UsageQuery) -> list[UsageRow]:
        """The same rows as :func:`aggregate_usage`, reusing unchanged buckets."""
        if query.tenant_id is None and supports_bucket_counts(session, replace(query, tenant_id=0)):
            return self._across_tenants(session, query)
        if not supports_bucket_counts(session, query):
            return aggregate_usage(session, query)
        assert query.width is not None
        step = query.width.delta
        first_whole = bucket_floor(query.start, query.width)
        if first_whole < query.start:
            first_whole += step
        last_whole = bucket_floor(query.end, query.width)
        if first_whole >= last_whole:
            return aggregate_usage(session, query)
        whole = replace(query, start=first_whole, end=last_whole)
        counts = bucket_row_counts(session, whole)
        found: dict[datetime, tuple[UsageRow, ...]] = {}
        for start, num_rows in counts.items():
            entry = self._lookup(self._key(query, start), num_rows)
            if entry is not None:
                found[start] = entry.rows
        stale = [start for start in counts if start not in found]
        for run_start, run_end in _runs(stale, query):
            fresh = aggregate_usage(session, replace(query, start=run_start, end=run_end))
            self._keep(query, run_start, run_end, fresh, found)
        edges = [(query.start, first_whole), (last_whole, query.end)]
        rows = [r for start in sorted(found) for r in found[start]]
        for edge_start, edge_end in edges:
            if edge_start < edge_end:
                edge = replace(query, start=edge_start, end=edge_end)
                rows.extend(aggregate_usage(session, edge))
        return sorted(rows, key=_order)

    def _across_tenants(self, session: Session, query: UsageQuery) -> list[UsageRow]:
        """Every tenant's cached answer, added up (tagged by tenant if grouped by it)."""
        by_tenant = GroupBy.TENANT in query.group_by
        inner_groups = tuple(g for g in query.group_by if g is not GroupBy.TENANT)
        merged: dict[tuple[object, ...], UsageRow] = {}
        for tenant_id in session.scalars(select(Tenant.id).order_by(Tenant.id)):
            mine = replace(query, tenant_id=tenant_id, group_by=inner_groups)
            for row in self.aggregate(session, mine):
                tagged = replace(row, tenant_id=tenant_id if by_tenant else None)
                key = (tagged.bucket_start, tagged.tenant_id, tagged.model, tagged.api_key_id)
                seen = merged.get(key)
                merged[key] = tagged if seen is None else replace(
                    seen, totals=seen.totals + tagged.totals
                )
        return sorted(merged.values(), key=_order)

    def _keep(
        self, query: UsageQuery, start: datetime, end: datetime, fresh: list[UsageRow],
        found: dict[datetime, tuple[UsageRow, ...]],
    ) -> None:
        assert query.width is not None
        cursor = start
        while cursor < end:
            mine = tuple(r for r in fresh if r.bucket_start == cursor)
            self._store(self._key(query, cursor), _Entry(sum(r.totals.num_requests for r in mine),
                                                         mine))
            found[cursor] = mine
            cursor += query.width.delta


def _order(row: UsageRow) -> tuple[datetime, str, str, int]:
    assert row.bucket_start is not None
    return (row.bucket_start, row.model or "", row.api_key_id or "", row.tenant_id or 0)
