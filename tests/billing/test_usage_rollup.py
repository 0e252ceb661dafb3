"""The hourly rollup equals the ledger, and the usage views built on it equal the ledger.

Property tests over random ledgers (duplicate request ids, replays with changed
content, batches and single writes, unaligned query ranges), on SQLite and on the
real PostgreSQL. The reference is computed here in Python from the ledger rows.
"""

from __future__ import annotations

import random
import uuid
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from billing.accounts import create_key, create_tenant
from billing.ledger import LedgerEntry, write_usage, write_usage_many
from billing.models import (
    ApiKeyId,
    RequestStatus,
    ServedBy,
    TenantId,
    UsageHourly,
    UsageRecord,
)
from billing.pricing import set_price
from billing.usage import BucketWidth, GroupBy, UsageQuery, UsageTotals, aggregate_usage
from billing.usage_rollup import _add_generic, rebuild_rollup

Factory = sessionmaker[Session]
T0 = datetime(2026, 4, 30, 20, 10, tzinfo=UTC)  # not hour-aligned; the span crosses a day
H0 = datetime(2026, 5, 1, tzinfo=UTC)  # a UTC day (and hour) start
SPAN_S = 8 * 3600  # short, so that partial edge hours usually hold rows
GroupKey = tuple[Any, ...]
Send = tuple[int, int, int, bool, int, int, int, int]


@st.composite
def sends(draw: st.DrawFn) -> list[Send]:
    """Requests as (offset_us, model, key, semantic, prompt, cached, completion, id slot)."""
    count = draw(st.integers(0, 30))
    num_ids = draw(st.integers(1, max(count, 1)))  # fewer ids than sends: duplicates
    out: list[Send] = []
    for _ in range(count):
        prompt = draw(st.integers(0, 5000))
        out.append((
            draw(st.integers(0, SPAN_S * 10**6 - 1)), draw(st.integers(0, 1)),
            draw(st.integers(0, 2)), draw(st.booleans()), prompt, draw(st.integers(0, prompt)),
            draw(st.integers(0, 900)), draw(st.integers(0, num_ids - 1)),
        ))
    return out


def _tenant(factory: Factory, tag: str) -> tuple[int, list[str], list[ApiKeyId | None]]:
    with factory.begin() as session:
        tenant = create_tenant(session, f"r-{tag}")
        keys: list[ApiKeyId | None] = [
            ApiKeyId(create_key(session, tenant.name)[0].id) for _ in range(2)
        ]
        models = [f"priced-{tag}", f"free-{tag}"]
        set_price(session, models[0], "1.5", "0.75", "6", "0.1", effective_from=T0)
    return tenant.id, models, [*keys, None]


def _entries(tenant_id: int, models: list[str], keys: list[ApiKeyId | None],
             requests: Sequence[Send], base: datetime = T0) -> list[LedgerEntry]:
    ids = [str(uuid.uuid4()) for _ in range(len(requests) + 1)]
    return [
        LedgerEntry(
            request_id=ids[slot], tenant_id=TenantId(tenant_id), api_key_id=keys[key],
            model=models[model], served_by=ServedBy.SEMANTIC if sem else ServedBy.ENGINE,
            status=RequestStatus.OK, prompt_tokens=prompt, cached_tokens=cached,
            completion_tokens=completion, similarity=None, worker=None,
            created_at=base + timedelta(microseconds=offset),
        )
        for offset, model, key, sem, prompt, cached, completion, slot in requests
    ]


def _write(factory: Factory, entries: list[LedgerEntry], rng: random.Random) -> None:
    """Singles and batches of varied size, in a shuffled order."""
    rng.shuffle(entries)
    while entries:
        size = rng.randint(1, 5)
        batch, entries = entries[:size], entries[size:]
        if size == 1:
            write_usage(factory, batch[0])
        else:
            write_usage_many(factory, batch)


def _floor(moment: datetime, width: BucketWidth | None) -> datetime | None:
    moment = moment.astimezone(UTC).replace(minute=0, second=0, microsecond=0)
    if width is None:
        return None
    return moment if width is BucketWidth.HOUR else moment.replace(hour=0)


def _row_totals(row: UsageRecord) -> UsageTotals:
    s = int(row.served_by == ServedBy.SEMANTIC)
    return UsageTotals(
        1, s, row.prompt_tokens, row.cached_tokens, row.completion_tokens,
        s * row.prompt_tokens, s * row.cached_tokens, s * row.completion_tokens,
        row.billed_pico, row.list_pico,
    )


def _reference(rows: list[UsageRecord], query: UsageQuery) -> dict[GroupKey, UsageTotals]:
    sums: dict[GroupKey, UsageTotals] = defaultdict(UsageTotals)
    for row in rows:
        if query.tenant_id not in (None, row.tenant_id):
            continue
        if not query.start <= row.created_at < query.end:
            continue
        key = (
            _floor(row.created_at, query.width),
            row.tenant_id if GroupBy.TENANT in query.group_by else None,
            row.model if GroupBy.MODEL in query.group_by else None,
            row.api_key_id if GroupBy.API_KEY in query.group_by else None,
        )
        sums[key] = sums[key] + _row_totals(row)
    return dict(sums)


def _answer(factory: Factory, query: UsageQuery) -> dict[GroupKey, UsageTotals]:
    with factory() as session:
        rows = aggregate_usage(session, query)
    answer = {(r.bucket_start, r.tenant_id, r.model, r.api_key_id): r.totals for r in rows}
    assert len(answer) == len(rows)
    return answer


def _rollup_reference(rows: list[UsageRecord]) -> dict[GroupKey, tuple[int, ...]]:
    sums: dict[GroupKey, tuple[int, ...]] = defaultdict(lambda: (0,) * 6)
    for r in rows:
        key = (r.tenant_id, _floor(r.created_at, BucketWidth.HOUR), r.model, r.api_key_id or "",
               r.served_by.value)
        row = (1, r.prompt_tokens, r.cached_tokens, r.completion_tokens, r.billed_pico,
               r.list_pico)
        sums[key] = tuple(a + b for a, b in zip(sums[key], row, strict=True))
    return dict(sums)


def _rollup(factory: Factory) -> dict[GroupKey, tuple[int, ...]]:
    with factory() as session:
        return {
            (h.tenant_id, h.hour, h.model, h.api_key_id, ServedBy(h.served_by).value): (
                h.num_requests, h.prompt_tokens, h.cached_tokens, h.completion_tokens,
                h.billed_pico, h.list_pico,
            )
            for h in session.scalars(select(UsageHourly))
        }


def _ledger(factory: Factory) -> list[UsageRecord]:
    with factory() as session:
        return list(session.scalars(select(UsageRecord)))


queries = st.tuples(
    st.integers(-3600 * 10**6, (SPAN_S + 3600) * 10**6),  # start, microseconds from T0
    st.integers(0, (SPAN_S + 3600) * 10**6),  # length
    st.sampled_from([None, *BucketWidth]),
    st.sets(st.sampled_from([GroupBy.MODEL, GroupBy.API_KEY])),
    st.sampled_from(["mine", "all", "all by tenant"]),
)


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(requests=sends(), asked=st.lists(queries, min_size=1, max_size=4), seed=st.integers(0, 99))
def test_rollup_and_usage_views_equal_the_ledger(
    factory: Factory, requests: list[Send], asked: list[tuple], seed: int
) -> None:
    tag = uuid.uuid4().hex[:10]
    tenant_id, models, keys = _tenant(factory, tag)
    entries = _entries(tenant_id, models, keys, requests)
    replays = [replace(e, completion_tokens=e.completion_tokens + 1) for e in entries[::3]]
    _write(factory, entries + replays, random.Random(seed))
    ledger = _ledger(factory)
    mine = [r for r in ledger if r.tenant_id == tenant_id]
    assert len(mine) == len({e.request_id for e in entries})
    assert _rollup(factory) == _rollup_reference(ledger)
    for start_us, length_us, width, groups, scope in asked:
        start = T0 + timedelta(microseconds=start_us)
        group_by = tuple(g for g in GroupBy if g in groups or (
            g is GroupBy.TENANT and scope == "all by tenant"))
        query = UsageQuery(start, start + timedelta(microseconds=length_us),
                           tenant_id if scope == "mine" else None, width=width,
                           group_by=group_by)
        assert _answer(factory, query) == _reference(ledger, query)


def test_a_duplicate_request_id_counts_once(factory: Factory) -> None:
    tenant_id, models, keys = _tenant(factory, "dup")
    entry = _entries(tenant_id, models, keys, [(0, 0, 2, False, 100, 40, 10, 0)], H0)[0]
    assert write_usage(factory, entry) is True
    assert write_usage(factory, replace(entry, prompt_tokens=999)) is False
    assert write_usage_many(factory, [entry, entry]) == 0
    ((key, sums),) = _rollup(factory).items()
    assert key == (tenant_id, H0, models[0], "", "engine")
    assert sums[:4] == (1, 100, 40, 10) and sums[4] > 0


def test_a_failed_batch_adds_nothing_to_the_rollup(factory: Factory) -> None:
    tenant_id, models, keys = _tenant(factory, "fail")
    good = _entries(tenant_id, models, keys, [(0, 0, 0, False, 10, 0, 1, 0)])[0]
    bad = replace(good, request_id=str(uuid.uuid4()), tenant_id=TenantId(987654))  # no tenant
    with pytest.raises(IntegrityError):
        write_usage_many(factory, [good, bad])
    assert _rollup(factory) == {} and _ledger(factory) == []


def test_rebuild_equals_the_incremental_rollup(factory: Factory) -> None:
    tenant_id, models, keys = _tenant(factory, "rebuild")
    rng = random.Random(4)
    requests = [
        (rng.randrange(SPAN_S * 10**6), rng.randint(0, 1), rng.randint(0, 2), rng.random() < 0.3,
         50, rng.randint(0, 50), rng.randint(0, 9), slot)
        for slot in range(60)
    ]
    write_usage_many(factory, _entries(tenant_id, models, keys, requests))
    incremental = _rollup(factory)
    with factory.begin() as session:
        rebuild_rollup(session)
    assert _rollup(factory) == incremental == _rollup_reference(_ledger(factory))


def test_whole_hours_are_read_from_the_rollup(factory: Factory) -> None:
    """The views answer whole hours from ``usage_hourly``, edges from the ledger."""
    tenant_id, models, keys = _tenant(factory, "source")
    at = [(0, 0, 2, False, 10, 0, 1, 0), (3600 * 10**6 + 5, 0, 2, False, 10, 0, 1, 1)]
    write_usage_many(factory, _entries(tenant_id, models, keys, at, H0))
    with factory.begin() as session:
        session.execute(update(UsageHourly).values(num_requests=UsageHourly.num_requests + 5))
    day = UsageQuery(H0, H0 + timedelta(days=1), tenant_id, width=BucketWidth.DAY)
    edge = UsageQuery(H0 + timedelta(hours=1), H0 + timedelta(hours=1, minutes=1), tenant_id)
    with factory() as session:
        assert aggregate_usage(session, day)[0].totals.num_requests == 2 + 2 * 5
        assert aggregate_usage(session, day, from_ledger=True)[0].totals.num_requests == 2
        assert aggregate_usage(session, edge)[0].totals.num_requests == 1


def test_portable_fallback_adds_like_the_upsert(factory: Factory) -> None:
    """Dialects without ``ON CONFLICT``: update, else insert; the same sums."""
    tenant_id, _, _ = _tenant(factory, "generic")
    values: dict[str, Any] = {
        "tenant_id": tenant_id, "hour": H0, "model": "m", "api_key_id": "", "served_by": "engine",
        "num_requests": 2, "prompt_tokens": 10, "cached_tokens": 4, "completion_tokens": 3,
        "billed_pico": 7, "list_pico": 9,
    }
    with factory.begin() as session:
        _add_generic(session, values)
        _add_generic(session, values)
    assert _rollup(factory) == {(tenant_id, H0, "m", "", "engine"): (4, 20, 8, 6, 14, 18)}
