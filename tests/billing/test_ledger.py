from __future__ import annotations

import random
import threading
import uuid
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from billing import accounts, pricing
from billing.ledger import LedgerEntry, LedgerWriter, get_usage, write_usage, write_usage_many
from billing.models import ApiKeyId, RequestStatus, ServedBy, TenantId, UsageRecord
from billing.rating import Usage, rate
from billing.usage import UsageQuery, aggregate_usage, total_usage

Factory = sessionmaker[Session]
T0 = datetime(2026, 1, 1, tzinfo=UTC)


def _setup(factory: Factory) -> tuple[TenantId, ApiKeyId]:
    with factory.begin() as session:
        tenant = accounts.create_tenant(session, "acme")
        key, _ = accounts.create_key(session, "acme")
        pricing.set_price(session, "smol", "0.15", "0.075", "0.6", "0.1", effective_from=T0)
        pricing.set_price(
            session, "smol", "0.30", "0.15", "1.2", "0.2", effective_from=T0 + timedelta(days=31)
        )
        return TenantId(tenant.id), ApiKeyId(key.id)


def _entry(tenant_id: TenantId, key_id: ApiKeyId | None, **changes: object) -> LedgerEntry:
    entry = LedgerEntry(
        request_id=str(uuid.uuid4()), tenant_id=tenant_id, api_key_id=key_id, model="smol",
        served_by=ServedBy.ENGINE, status=RequestStatus.OK, prompt_tokens=100,
        cached_tokens=40, completion_tokens=20, similarity=None, worker="w0",
        created_at=T0 + timedelta(days=1), latency_ms=12.5, ttft_ms=3.0,
    )
    return replace(entry, **changes)  # type: ignore[arg-type]


def _rows(factory: Factory) -> int:
    with factory() as session:
        return session.scalar(select(func.count()).select_from(UsageRecord)) or 0


def test_write_rates_at_the_price_in_force_and_is_idempotent(factory: Factory) -> None:
    tenant_id, key_id = _setup(factory)
    january = _entry(tenant_id, key_id)
    february = _entry(tenant_id, key_id, created_at=T0 + timedelta(days=40))
    assert write_usage(factory, january) is True
    assert write_usage(factory, january) is False
    assert write_usage(factory, replace(january, request_id=january.request_id.upper())) is False
    assert write_usage(factory, replace(january, prompt_tokens=999)) is False
    assert write_usage(factory, february) is True
    assert _rows(factory) == 2
    with factory() as session:
        first = get_usage(session, january.request_id)
        second = get_usage(session, february.request_id)
        assert first is not None and second is not None
        assert (first.billed_pico, first.list_pico) == (24_000_000, 27_000_000)
        assert (second.billed_pico, second.list_pico) == (48_000_000, 54_000_000)
        assert first.price_id is not None and first.price_id != second.price_id
        assert first.prompt_tokens == 100 and first.created_at == january.created_at
        assert get_usage(session, january.request_id.upper()) is not None
        assert get_usage(session, "not-a-uuid") is None
        assert first.served_by is ServedBy.ENGINE and first.status is RequestStatus.OK


def test_one_batch_across_a_price_change_rates_each_entry_at_its_own_price(
    factory: Factory,
) -> None:
    """The batched price lookup: a batch whose entries straddle a price change."""
    tenant_id, key_id = _setup(factory)
    days = [1, 40, 2, 30, 31]
    entries = [_entry(tenant_id, key_id, created_at=T0 + timedelta(days=d)) for d in days]
    assert write_usage_many(factory, entries) == len(entries)
    with factory() as session:
        billed = [get_usage(session, e.request_id) for e in entries]
        assert [r.billed_pico if r else None for r in billed] == [
            24_000_000, 48_000_000, 24_000_000, 24_000_000, 48_000_000]


def test_a_kept_writer_sees_every_new_price(factory: Factory) -> None:
    """The writer reuses the price history it loaded only while the price table is
    unchanged: a price added later (even one effective in the past, for a model that
    had none) rates the next batch."""
    tenant_id, key_id = _setup(factory)
    writer = LedgerWriter(factory)
    day_40 = T0 + timedelta(days=40)
    first = [_entry(tenant_id, key_id, created_at=day_40), _entry(tenant_id, key_id,
                                                                   model="new-model")]
    assert writer.write(first) == 2
    with factory.begin() as session:
        pricing.set_price(session, "smol", "0.60", "0.30", "2.4", "0.4",
                          effective_from=T0 + timedelta(days=35))
        pricing.set_price(session, "new-model", "1", "1", "1", "1", effective_from=T0)
    second = [_entry(tenant_id, key_id, created_at=day_40), _entry(tenant_id, key_id,
                                                                    model="new-model")]
    assert writer.write(second) == 2
    with factory() as session:
        billed = [get_usage(session, e.request_id) for e in first + second]
        assert [r.billed_pico if r else None for r in billed] == [
            48_000_000, 0, 96_000_000, 120_000_000]


def test_semantic_hit_and_missing_price(factory: Factory) -> None:
    tenant_id, key_id = _setup(factory)
    hit = _entry(tenant_id, key_id, served_by=ServedBy.SEMANTIC, similarity=0.97, cached_tokens=0)
    unpriced = _entry(tenant_id, None, model="no-price-yet")
    early = _entry(tenant_id, key_id, created_at=T0 - timedelta(seconds=1))
    assert write_usage_many(factory, [hit, unpriced, early, hit]) == 3
    with factory() as session:
        row = get_usage(session, hit.request_id)
        assert row is not None and (row.billed_pico, row.list_pico) == (2_700_000, 27_000_000)
        assert row.similarity == pytest.approx(0.97)
        for entry in (unpriced, early):
            row = get_usage(session, entry.request_id)
            assert row is not None and row.price_id is None
            assert (row.billed_pico, row.list_pico) == (0, 0)


def test_bad_entries_raise_and_write_nothing(factory: Factory) -> None:
    tenant_id, key_id = _setup(factory)
    good = _entry(tenant_id, key_id)
    with pytest.raises(ValueError, match="exceed"):
        write_usage(factory, _entry(tenant_id, key_id, cached_tokens=101))
    with pytest.raises(ValueError, match="UUID"):
        write_usage(factory, _entry(tenant_id, key_id, request_id="not-a-uuid"))
    with pytest.raises(ValueError, match="aware"):
        write_usage(factory, _entry(tenant_id, key_id, created_at=datetime(2026, 1, 2)))
    with pytest.raises(ValueError):
        write_usage_many(factory, [good, _entry(tenant_id, key_id, completion_tokens=-1)])
    with pytest.raises(ValueError, match="tier"):
        write_usage(factory, _entry(tenant_id, key_id, tier_host_cached_tokens=30,
                                    tier_shared_cached_tokens=11))  # 41 > 40 cached
    with pytest.raises(ValueError, match="tier"):
        write_usage(factory, _entry(tenant_id, key_id, tier_shared_cached_tokens=-1))
    with pytest.raises(IntegrityError):  # unknown tenant: the database refuses, we never drop
        write_usage(factory, _entry(TenantId(999_999), None))
    assert _rows(factory) == 0


def test_tier_layers_are_recorded_and_summed(factory: Factory) -> None:
    tenant_id, key_id = _setup(factory)
    tiered = _entry(tenant_id, key_id, tier_host_cached_tokens=16, tier_shared_cached_tokens=24)
    hour_later = replace(tiered, request_id=str(uuid.uuid4()),
                         created_at=tiered.created_at + timedelta(hours=1))
    untiered = _entry(tenant_id, key_id)  # no tier: NULL, counts 0 in the sums
    write_usage_many(factory, [tiered, hour_later, untiered])
    with factory() as session:
        row = get_usage(session, tiered.request_id)
        plain = get_usage(session, untiered.request_id)
        assert row is not None and plain is not None
        assert (row.tier_host_cached_tokens, row.tier_shared_cached_tokens) == (16, 24)
        assert (plain.tier_host_cached_tokens, plain.tier_shared_cached_tokens) == (None, None)
        query = UsageQuery(start=T0, end=T0 + timedelta(days=3), tenant_id=tenant_id)
        from_rollup = total_usage(session, query)
        (from_ledger,) = aggregate_usage(session, query, from_ledger=True)
        for totals in (from_rollup, from_ledger.totals):
            assert (totals.tier_host_cached_tokens, totals.tier_shared_cached_tokens) == (32, 48)
            assert totals.cached_tokens == 120


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 5),
            st.integers(0, 5000),
            st.integers(0, 5000),
            st.integers(0, 5000),
            st.sampled_from(ServedBy),
        ),
        min_size=1,
        max_size=12,
    )
)
def test_property_one_row_per_request_id_with_exact_amounts(
    sqlite_factory: Factory, draws: list[tuple[int, int, int, int, ServedBy]]
) -> None:
    with sqlite_factory.begin() as session:
        tenant = accounts.get_tenant_by_name(session, "acme") or accounts.create_tenant(
            session, "acme"
        )
        if not pricing.list_prices(session):
            pricing.set_price(session, "smol", "0.15", "0.075", "0.6", "0.1", effective_from=T0)
    ids = [str(uuid.uuid4()) for _ in range(6)]
    first_seen: dict[str, LedgerEntry] = {}
    for index, prompt, cached, completion, served_by in draws:
        entry = _entry(
            TenantId(tenant.id), None, request_id=ids[index], prompt_tokens=prompt,
            cached_tokens=min(cached, prompt), completion_tokens=completion, served_by=served_by,
        )
        inserted = write_usage(sqlite_factory, entry)
        assert inserted is (ids[index] not in first_seen)
        first_seen.setdefault(ids[index], entry)
    with sqlite_factory() as session:
        rows = session.scalars(select(UsageRecord).where(UsageRecord.request_id.in_(ids))).all()
        price = pricing.price_in_force(session, "smol", T0)
    assert price is not None and len(rows) == len(first_seen)
    for row in rows:
        entry = first_seen[row.request_id]
        charge = rate(Usage(entry.prompt_tokens, entry.cached_tokens, entry.completion_tokens,
                            entry.served_by), price)
        assert (row.billed_pico, row.list_pico) == (charge.billed_pico, charge.list_pico)
        assert 0 <= row.billed_pico <= row.list_pico


def test_concurrent_writers_record_each_request_once(factory: Factory) -> None:
    tenant_id, key_id = _setup(factory)
    entries = [_entry(tenant_id, key_id) for _ in range(20)]
    num_writers = 4
    barrier = threading.Barrier(num_writers)
    results: list[list[bool]] = [[] for _ in range(num_writers)]
    errors: list[BaseException] = []

    def writer(slot: int) -> None:
        try:
            barrier.wait()
            for entry in entries:
                results[slot].append(write_usage(factory, entry))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(slot,)) for slot in range(num_writers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    for position in range(len(entries)):
        assert sum(results[slot][position] for slot in range(num_writers)) == 1
    assert _rows(factory) == len(entries)


@pytest.mark.parametrize("migrated_url", ["postgres"], indirect=True)
def test_portable_fallback_path_also_ignores_duplicates(factory: Factory) -> None:
    """The savepoint path used for dialects without ON CONFLICT, exercised on PostgreSQL."""
    from billing.ledger import _insert_generic, _row_values

    tenant_id, key_id = _setup(factory)
    entry = _entry(tenant_id, key_id)
    with factory.begin() as session:
        values = _row_values(session, entry)
        assert _insert_generic(session, values) is True
        assert _insert_generic(session, dict(values)) is False
    with pytest.raises(IntegrityError), factory.begin() as session:
        _insert_generic(session, _row_values(session, _entry(TenantId(424242), None)))
    assert _rows(factory) == 1


def test_sql_sums_of_large_amounts_are_exact(factory: Factory) -> None:
    """Totals past 2**53 picodollars: a float anywhere on the way would lose cents."""
    generator = random.Random(7)
    with factory.begin() as session:
        tenant_id = TenantId(accounts.create_tenant(session, "big").id)
        pricing.set_price(session, "huge", "9999.999999", "4999.999999", "9999.999997", "0.333333",
                          effective_from=T0)
        price = pricing.price_in_force(session, "huge", T0)
    assert price is not None
    entries = []
    for _ in range(30):
        prompt = generator.randint(1_000_000, 2_000_000)
        entries.append(_entry(
            tenant_id, None, model="huge", prompt_tokens=prompt,
            cached_tokens=generator.randint(0, prompt), completion_tokens=generator.randint(0, 9),
            served_by=generator.choice(list(ServedBy)),
        ))
    assert write_usage_many(factory, entries) == len(entries)
    expected = [rate(e.usage, price) for e in entries]
    with factory() as session:
        billed, listed = session.execute(
            select(func.sum(UsageRecord.billed_pico), func.sum(UsageRecord.list_pico))
        ).one()
    assert int(billed) == sum(c.billed_pico for c in expected) > 2**53
    assert int(listed) == sum(c.list_pico for c in expected)
