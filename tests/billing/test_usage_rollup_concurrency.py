"""Concurrent writers on the same rollup rows lose no increment and never deadlock."""

from __future__ import annotations

import threading
import uuid
from datetime import UTC, datetime, timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from billing.accounts import create_key, create_tenant
from billing.ledger import LedgerEntry, write_usage, write_usage_many
from billing.models import ApiKeyId, RequestStatus, ServedBy, TenantId, UsageHourly

Factory = sessionmaker[Session]
HOUR = datetime(2026, 6, 1, 10, tzinfo=UTC)
NUM_WRITERS = 6
SINGLES = 12


def _entry(tenant_id: int, key_id: str, model: str, minute: int) -> LedgerEntry:
    return LedgerEntry(
        request_id=str(uuid.uuid4()), tenant_id=TenantId(tenant_id),
        api_key_id=ApiKeyId(key_id), model=model, served_by=ServedBy.ENGINE,
        status=RequestStatus.OK, prompt_tokens=7, cached_tokens=3, completion_tokens=2,
        similarity=None, worker="w0", created_at=HOUR + timedelta(minutes=minute),
    )


def test_concurrent_writers_add_up_exactly(factory: Factory) -> None:
    """Every writer hits the same rollup rows: singles, shared duplicates, batches in
    opposite row orders (two rows each: a lock-order deadlock would show here)."""
    with factory.begin() as session:
        tenant_id = create_tenant(session, "busy").id
        key_id = create_key(session, "busy")[0].id
    shared = [_entry(tenant_id, key_id, "a", 30) for _ in range(4)]
    barrier = threading.Barrier(NUM_WRITERS)
    errors: list[BaseException] = []

    def writer(slot: int) -> None:
        try:
            barrier.wait(30)
            for i in range(SINGLES):
                write_usage(factory, _entry(tenant_id, key_id, "a", i))
                if i % 3 == 0:
                    pair = [_entry(tenant_id, key_id, m, i) for m in ("a", "b")]
                    write_usage_many(factory, pair if slot % 2 else pair[::-1])
            write_usage_many(factory, shared if slot % 2 else shared[::-1])
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(slot,)) for slot in range(NUM_WRITERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert errors == []
    with factory() as session:
        rows = {h.model: h for h in session.scalars(select(UsageHourly))}
    pairs = NUM_WRITERS * len(range(0, SINGLES, 3))
    expected_a = NUM_WRITERS * SINGLES + pairs + len(shared)
    assert set(rows) == {"a", "b"}
    assert rows["a"].num_requests == expected_a and rows["b"].num_requests == pairs
    assert (rows["a"].prompt_tokens, rows["a"].cached_tokens, rows["a"].completion_tokens) == (
        7 * expected_a, 3 * expected_a, 2 * expected_a
    )
