"""The hourly usage rollup: ledger sums per (tenant, UTC hour, model, key, served_by).

Algorithm: every ledger row that is actually inserted (``ON CONFLICT DO NOTHING
RETURNING`` answered a row) adds its counts to its ``usage_hourly`` row in the
*same transaction*, with ``INSERT ... ON CONFLICT (key) DO UPDATE SET
n = usage_hourly.n + excluded.n``. The upsert is atomic: on PostgreSQL a second
writer on the same row waits for the first one's row lock and then adds to the
committed value; SQLite serialises writers. So no increment is lost, a duplicate
request id (nothing inserted) adds nothing, and a rolled-back transaction takes
its increments with it: the rollup always equals ``GROUP BY`` over the committed
ledger, exactly. Ledger rows are never deleted and their counted columns never
change (an invoice only sets ``invoice_id``), so nothing else has to maintain it.

A transaction first sums its increments per rollup row (:class:`RollupDeltas`)
and applies them in key order at the end, so batches that touch the same rows
lock them in the same order and cannot deadlock each other.

:func:`rebuild_rollup` recomputes the table from the ledger with one
``INSERT ... SELECT ... GROUP BY`` (bulk loads, repair); the 0002 migration
backfills with the same statement.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, cast

from sqlalchemy import CursorResult, Insert, Table, delete, insert, text, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from billing.models import NO_API_KEY, ServedBy, UsageHourly

KEY_COLUMNS = ("tenant_id", "hour", "model", "api_key_id", "served_by")
SUMMED_COLUMNS = (
    "prompt_tokens", "cached_tokens", "completion_tokens", "billed_pico", "list_pico",
    "tier_host_cached_tokens", "tier_shared_cached_tokens",  # NULL in the ledger counts 0
)
COUNT_COLUMNS = ("num_requests", *SUMMED_COLUMNS)

# The UTC hour of ``created_at`` in the storage format of each backend: PostgreSQL
# ``timestamptz``; SQLite the text SQLAlchemy writes for a naive UTC datetime.
HOUR_SQL = {
    "postgresql": "date_trunc('hour', created_at AT TIME ZONE 'UTC') AT TIME ZONE 'UTC'",
    "sqlite": "strftime('%Y-%m-%d %H:00:00.000000', created_at)",
}


def backfill_sql(dialect: str) -> str:
    """``INSERT ... SELECT`` adding the whole ledger, grouped, to an empty rollup."""
    if dialect not in HOUR_SQL:
        raise ValueError(f"unsupported database dialect {dialect!r}")
    return (
        f"INSERT INTO usage_hourly ({', '.join(KEY_COLUMNS + COUNT_COLUMNS)})"
        f" SELECT tenant_id, {HOUR_SQL[dialect]}, model, COALESCE(api_key_id, '{NO_API_KEY}'),"
        " served_by, COUNT(*), "
        + ", ".join(f"COALESCE(SUM({c}), 0)" for c in SUMMED_COLUMNS)
        + " FROM usage_ledger GROUP BY 1, 2, 3, 4, 5"
    )


def hour_of(moment: datetime) -> datetime:
    """The UTC hour holding ``moment`` (aware)."""
    return moment.astimezone(UTC).replace(minute=0, second=0, microsecond=0)


@dataclass(frozen=True, order=True)
class RollupKey:
    """The grouping columns of one rollup row."""

    tenant_id: int
    hour: datetime
    model: str
    api_key_id: str
    served_by: str


def rollup_key(row: Mapping[str, Any]) -> RollupKey:
    """The rollup row a ledger row (its column values) counts in."""
    return RollupKey(
        tenant_id=int(row["tenant_id"]),
        hour=hour_of(row["created_at"]),
        model=str(row["model"]),
        api_key_id=row["api_key_id"] or NO_API_KEY,
        served_by=ServedBy(row["served_by"]).value,
    )


class RollupDeltas:
    """The increments of one transaction, summed per rollup row until applied."""

    def __init__(self) -> None:
        self._sums: dict[RollupKey, list[int]] = {}

    def add(self, row: Mapping[str, Any]) -> None:
        """Count one inserted ledger row (its column values)."""
        sums = self._sums.setdefault(rollup_key(row), [0] * len(COUNT_COLUMNS))
        sums[0] += 1
        for i, name in enumerate(SUMMED_COLUMNS, start=1):
            sums[i] += int(row.get(name) or 0)

    def apply(self, session: Session, upsert: Insert | None = None) -> None:
        """Add every increment to its rollup row, in key order (one executemany of
        ``upsert``, :func:`upsert_statement` of the session's dialect, built here when
        not given); then forget them."""
        dialect = session.get_bind().dialect.name
        rows = []
        for key in sorted(self._sums):
            values = {name: getattr(key, name) for name in KEY_COLUMNS}
            values.update(zip(COUNT_COLUMNS, self._sums[key], strict=True))
            rows.append(values)
        self._sums.clear()
        if not rows:
            return
        if dialect not in ("postgresql", "sqlite"):
            for values in rows:
                _add_generic(session, values)
            return
        session.execute(upsert if upsert is not None else upsert_statement(dialect), rows)


def _table() -> Table:
    return cast(Table, UsageHourly.__table__)


def upsert_statement(dialect: str) -> Insert:
    """``INSERT ... ON CONFLICT (key) DO UPDATE SET n = n + excluded.n`` for PostgreSQL
    or SQLite, to execute with one parameter dict per rollup row."""
    table = _table()
    stmt = postgresql.insert(table) if dialect == "postgresql" else sqlite.insert(table)
    return stmt.on_conflict_do_update(
        index_elements=list(KEY_COLUMNS),
        set_={name: table.c[name] + stmt.excluded[name] for name in COUNT_COLUMNS},
    )


def _add_generic(session: Session, values: dict[str, Any]) -> None:
    """Other dialects: update, else insert (a racing first insert raises: replay it)."""
    table = _table()
    where = [table.c[name] == values[name] for name in KEY_COLUMNS]
    increments = {name: table.c[name] + values.get(name, 0) for name in COUNT_COLUMNS}
    result = session.execute(update(table).where(*where).values(increments))
    if cast(CursorResult[Any], result).rowcount:
        return
    try:
        with session.begin_nested():
            session.execute(insert(table).values(values))
    except IntegrityError:
        session.execute(update(table).where(*where).values(increments))


def rebuild_rollup(session: Session) -> None:
    """Recompute the whole rollup from the ledger (bulk loads, repair).

    On PostgreSQL the ledger is locked against writers (``SHARE`` mode) until the
    transaction ends, so no row can slip between the delete and the insert.
    """
    dialect = session.get_bind().dialect.name
    if dialect == "postgresql":
        session.execute(text("LOCK TABLE usage_ledger IN SHARE MODE"))
    session.execute(delete(UsageHourly))
    session.execute(text(backfill_sql(dialect)))
