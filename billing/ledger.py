"""The usage ledger: one row per request, written exactly once, never silently dropped.

:func:`write_usage` rates the request against the price in force at its arrival
time (no price: zero amounts and ``price_id`` NULL) and inserts it with
``INSERT ... ON CONFLICT (request_id) DO NOTHING``. The unique ``request_id`` makes a
retry (outbox replay, a second proxy replica) a no-op, also under concurrent
writers: PostgreSQL makes the second inserter wait for the first and then skip;
SQLite serialises writers (WAL + busy timeout). Each row actually inserted is
also added, in the same transaction, to the hourly rollup that the usage views
read (:mod:`billing.usage_rollup`); a duplicate adds nothing. Database errors
propagate: the caller keeps the entry (the proxy's outbox) and replays it later.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, cast

from sqlalchemy import Insert, Table, insert, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from billing.models import ApiKeyId, Price, RequestStatus, ServedBy, TenantId, UsageRecord
from billing.pricing import price_in_force
from billing.rating import ZERO_CHARGE, Usage, rate, validate_usage
from billing.usage_rollup import RollupDeltas


@dataclass(frozen=True)
class LedgerEntry:
    """What the proxy knows about one finished request (``created_at`` = arrival, aware)."""

    request_id: str
    tenant_id: TenantId
    api_key_id: ApiKeyId | None
    model: str
    served_by: ServedBy
    status: RequestStatus
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    similarity: float | None
    worker: str | None
    created_at: datetime
    latency_ms: float | None = None
    ttft_ms: float | None = None

    @property
    def usage(self) -> Usage:
        return Usage(
            prompt_tokens=self.prompt_tokens,
            cached_tokens=self.cached_tokens,
            completion_tokens=self.completion_tokens,
            served_by=ServedBy(self.served_by),
        )


def validate_entry(entry: LedgerEntry) -> None:
    """Raise ``ValueError`` for an entry that must never reach the ledger."""
    try:
        uuid.UUID(entry.request_id)
    except (ValueError, TypeError, AttributeError):
        raise ValueError(f"request_id must be a UUID, got {entry.request_id!r}") from None
    if entry.created_at.tzinfo is None or entry.created_at.utcoffset() is None:
        raise ValueError("created_at must be an aware datetime")
    validate_usage(entry.usage)


def _row_values(session: Session, entry: LedgerEntry) -> dict[str, Any]:
    """One entry's column values, validated and rated on its own."""
    validate_entry(entry)
    return _rated_row(entry, price_in_force(session, entry.model, entry.created_at))


def _rated_row(entry: LedgerEntry, price: Price | None) -> dict[str, Any]:
    charge = ZERO_CHARGE if price is None else rate(entry.usage, price)
    return {
        "request_id": str(uuid.UUID(entry.request_id)),
        "tenant_id": entry.tenant_id,
        "api_key_id": entry.api_key_id,
        "model": entry.model,
        "served_by": ServedBy(entry.served_by),
        "status": RequestStatus(entry.status),
        "prompt_tokens": entry.prompt_tokens,
        "cached_tokens": entry.cached_tokens,
        "completion_tokens": entry.completion_tokens,
        "similarity": entry.similarity,
        "worker": entry.worker,
        "created_at": entry.created_at,
        "recorded_at": datetime.now(UTC),
        "latency_ms": entry.latency_ms,
        "ttft_ms": entry.ttft_ms,
        "price_id": None if price is None else price.id,
        "billed_pico": charge.billed_pico,
        "list_pico": charge.list_pico,
    }


def _prices(session: Session, entries: list[LedgerEntry]) -> list[Price | None]:
    """The price in force for each entry, with two lookups per model when one price
    covers the model's whole batch (the usual case: the price in force only moves
    forward in time), else one lookup per entry of that model."""
    by_model: dict[str, list[int]] = {}
    for i, entry in enumerate(entries):
        by_model.setdefault(entry.model, []).append(i)
    found: list[Price | None] = [None] * len(entries)
    for model, indexes in by_model.items():
        first = min(entries[i].created_at for i in indexes)
        last = max(entries[i].created_at for i in indexes)
        early = price_in_force(session, model, first)
        late = early if first == last else price_in_force(session, model, last)
        same = (early is None and late is None) or (
            early is not None and late is not None and early.id == late.id)
        for i in indexes:
            found[i] = early if same else price_in_force(session, model, entries[i].created_at)
    return found


def _insert_many_ignoring_duplicates(
    session: Session, rows: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Insert ``rows`` (distinct request ids, in id order) with one Core executemany;
    returns the rows actually inserted (a request id already recorded is skipped)."""
    dialect = session.get_bind().dialect.name
    table = cast(Table, UsageRecord.__table__)
    statement: Insert
    if dialect == "postgresql":
        statement = postgresql.insert(table).on_conflict_do_nothing(index_elements=["request_id"])
    elif dialect == "sqlite":
        statement = sqlite.insert(table).on_conflict_do_nothing(index_elements=["request_id"])
    else:
        return [values for values in rows if _insert_generic(session, values)]
    result = session.execute(statement.returning(table.c.request_id), rows)
    inserted = {str(rid) for rid in result.scalars()}
    return [values for values in rows if values["request_id"] in inserted]


def _insert_generic(session: Session, values: dict[str, Any]) -> bool:
    """Other dialects: insert in a savepoint; a duplicate request id is not an error."""
    try:
        with session.begin_nested():
            session.execute(insert(UsageRecord).values(values))
    except IntegrityError:
        exists = select(UsageRecord.id).where(UsageRecord.request_id == values["request_id"])
        if session.scalar(exists) is None:
            raise
        return False
    return True


def write_usage(factory: sessionmaker[Session], entry: LedgerEntry) -> bool:
    """Rate and record one request; True if inserted, False if already recorded.

    Raises ``ValueError`` for an impossible entry and SQLAlchemy errors for database
    failures; it never drops a row silently.
    """
    return write_usage_many(factory, [entry]) == 1


def write_usage_many(factory: sessionmaker[Session], entries: Iterable[LedgerEntry]) -> int:
    """Record several entries in one transaction (outbox replay); returns how many were new.

    All or nothing: on any error nothing is written and the error propagates. Rows
    are inserted in request id order (the first of several equal ids wins), so two
    writers replaying overlapping batches lock the same ids in the same order and
    cannot deadlock; rollup rows are then updated in key order, for the same reason.
    """
    batch = list(entries)
    for entry in batch:
        validate_entry(entry)
    deltas = RollupDeltas()
    with factory.begin() as session:
        unique: dict[str, dict[str, Any]] = {}
        for entry, price in zip(batch, _prices(session, batch), strict=True):
            values = _rated_row(entry, price)
            unique.setdefault(values["request_id"], values)  # the first of equal ids wins
        rows = [unique[rid] for rid in sorted(unique)]
        inserted = _insert_many_ignoring_duplicates(session, rows) if rows else []
        for values in inserted:
            deltas.add(values)
        deltas.apply(session)
    return len(inserted)


def get_usage(session: Session, request_id: str) -> UsageRecord | None:
    """The ledger row for ``request_id`` (any UUID spelling), if recorded."""
    try:
        canonical = str(uuid.UUID(request_id))
    except (ValueError, TypeError, AttributeError):
        return None
    query = select(UsageRecord).where(UsageRecord.request_id == canonical)
    return session.scalars(query).first()
