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

A batch costs one look at the price table (``count``, ``max(id)``: prices are only
added, so the history loaded earlier is reused while they are unchanged), one
multi-row insert and one executemany upsert of its rollup rows;
:class:`LedgerWriter` keeps the statements and the price history (the proxy's outbox
drainer keeps one writer), :func:`write_usage_many` builds them per call.
"""

from __future__ import annotations

import bisect
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, cast

from sqlalchemy import Insert, Table, func, insert, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from billing.models import ApiKeyId, Price, RequestStatus, ServedBy, TenantId, UsageRecord
from billing.pricing import price_in_force
from billing.rating import ZERO_CHARGE, Usage, rate, validate_usage
from billing.usage_rollup import RollupDeltas, upsert_statement


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
    cut: bool = False  # a stream cut short (proxy.progress): billed what it had delivered
    # Of cached_tokens, those a KV tier loaded (host tier / shared store); None: unknown.
    tier_host_cached_tokens: int | None = None
    tier_shared_cached_tokens: int | None = None

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
    tiers = [n for n in (entry.tier_host_cached_tokens, entry.tier_shared_cached_tokens)
             if n is not None]
    if any(n < 0 for n in tiers) or sum(tiers) > entry.cached_tokens:
        raise ValueError("tier cached tokens must be non-negative and within cached_tokens")


def _row_values(session: Session, entry: LedgerEntry) -> dict[str, Any]:
    """One entry's column values, validated and rated on its own."""
    validate_entry(entry)
    return _rated_row(entry, price_in_force(session, entry.model, entry.created_at))


def _rated_row(entry: LedgerEntry, price: Price | _PriceRow | None) -> dict[str, Any]:
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
        "cut": bool(entry.cut),
        "tier_host_cached_tokens": entry.tier_host_cached_tokens,
        "tier_shared_cached_tokens": entry.tier_shared_cached_tokens,
        "price_id": None if price is None else price.id,
        "billed_pico": charge.billed_pico,
        "list_pico": charge.list_pico,
    }


@dataclass(frozen=True)
class _PriceRow:
    """A price row's values, detached from any session (rating reads them)."""

    id: int
    effective_from: datetime
    input_pico: int
    cached_input_pico: int
    output_pico: int
    semantic_hit_ppm: int


class _PriceHistory:
    """Every price row by model, oldest first, as loaded at one state of the table."""

    def __init__(self, prices: Iterable[Price]) -> None:
        self._prices: dict[str, list[_PriceRow]] = {}
        for p in prices:
            self._prices.setdefault(p.model, []).append(_PriceRow(
                p.id, p.effective_from, p.input_pico, p.cached_input_pico, p.output_pico,
                p.semantic_hit_ppm))
        self._starts = {model: [p.effective_from for p in ps] for model, ps in self._prices.items()}

    def in_force(self, model: str, at: datetime) -> _PriceRow | None:
        """The price of ``model`` with the latest ``effective_from`` at or before ``at``."""
        prices = self._prices.get(model)
        if not prices:
            return None
        starts = self._starts[model]
        if at >= starts[-1]:  # the usual case: the newest price
            return prices[-1]
        i = bisect.bisect_right(starts, at)
        return prices[i - 1] if i else None


def _price_table_state(session: Session) -> tuple[int, int | None]:
    """``(count, max id)`` of the price table: prices are only ever added (a change is a
    new row), so an unchanged pair means an unchanged table."""
    row = session.execute(select(func.count(Price.id), func.max(Price.id))).one()
    return int(row[0]), row[1]


class LedgerWriter:
    """:func:`write_usage_many` with its insert and rollup statements built once per
    dialect (keep one per database: the outbox drainer writes a batch every few
    hundred milliseconds)."""

    def __init__(self, factory: sessionmaker[Session]) -> None:
        self._factory = factory
        self._inserts: dict[str, Insert] = {}
        self._upserts: dict[str, Insert] = {}
        self._history: _PriceHistory | None = None
        self._history_state: tuple[int, int | None] | None = None

    def _prices(self, session: Session, entries: list[LedgerEntry]) -> list[_PriceRow | None]:
        """The price in force for each entry, from the price history, reloaded (in this
        transaction) only when the price table changed since it was loaded."""
        state = _price_table_state(session)
        if self._history is None or state != self._history_state:
            query = select(Price).order_by(Price.model, Price.effective_from)
            self._history = _PriceHistory(session.scalars(query))
            self._history_state = state
        history = self._history
        return [history.in_force(entry.model, entry.created_at) for entry in entries]

    def write(self, entries: Iterable[LedgerEntry]) -> int:
        """See :func:`write_usage_many`."""
        batch = list(entries)
        for entry in batch:
            validate_entry(entry)
        if not batch:
            return 0
        deltas = RollupDeltas()
        with self._factory.begin() as session:
            unique: dict[str, dict[str, Any]] = {}
            for entry, price in zip(batch, self._prices(session, batch), strict=True):
                values = _rated_row(entry, price)
                unique.setdefault(values["request_id"], values)  # the first of equal ids wins
            rows = [unique[rid] for rid in sorted(unique)]
            inserted = self._insert_ignoring_duplicates(session, rows)
            for values in inserted:
                deltas.add(values)
            dialect = session.get_bind().dialect.name
            upsert = None
            if dialect in ("postgresql", "sqlite"):
                upsert = self._upserts.get(dialect)
                if upsert is None:
                    upsert = self._upserts[dialect] = upsert_statement(dialect)
            deltas.apply(session, upsert)
        return len(inserted)

    def _insert_ignoring_duplicates(
        self, session: Session, rows: list[dict[str, Any]]
    ) -> list[dict[str, Any]]:
        dialect = session.get_bind().dialect.name
        statement = self._inserts.get(dialect)
        if statement is None:
            statement = insert_ignoring_duplicates(dialect)
            if statement is not None:
                self._inserts[dialect] = statement
        return _insert_many_ignoring_duplicates(session, rows, statement)


def insert_ignoring_duplicates(dialect: str) -> Insert | None:
    """``INSERT ... ON CONFLICT (request_id) DO NOTHING RETURNING request_id`` for
    PostgreSQL or SQLite (None for other dialects)."""
    table = cast(Table, UsageRecord.__table__)
    if dialect == "postgresql":
        base: Insert = postgresql.insert(table).on_conflict_do_nothing(
            index_elements=["request_id"])
    elif dialect == "sqlite":
        base = sqlite.insert(table).on_conflict_do_nothing(index_elements=["request_id"])
    else:
        return None
    return base.returning(table.c.request_id)


def _insert_many_ignoring_duplicates(
    session: Session, rows: list[dict[str, Any]], statement: Insert | None = None
) -> list[dict[str, Any]]:
    """Insert ``rows`` (distinct request ids, in id order) with one Core executemany of
    ``statement`` (:func:`insert_ignoring_duplicates`, built here when not given);
    returns the rows actually inserted (a request id already recorded is skipped)."""
    if statement is None:
        statement = insert_ignoring_duplicates(session.get_bind().dialect.name)
        if statement is None:
            return [values for values in rows if _insert_generic(session, values)]
    result = session.execute(statement, rows)
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
    return LedgerWriter(factory).write(entries)


def get_usage(session: Session, request_id: str) -> UsageRecord | None:
    """The ledger row for ``request_id`` (any UUID spelling), if recorded."""
    try:
        canonical = str(uuid.UUID(request_id))
    except (ValueError, TypeError, AttributeError):
        return None
    query = select(UsageRecord).where(UsageRecord.request_id == canonical)
    return session.scalars(query).first()
