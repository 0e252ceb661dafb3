"""Aggregate usage queries: time buckets, per model / key / tenant, exact.

Algorithm: one ``SELECT`` per question, aggregated in SQL. The range
``[start, end)`` is split at whole UTC hours:

    start    first whole hour                 last whole hour    end
      |-- ledger --|======== usage_hourly (rollup) ========|-- ledger --|

The whole hours are read from the hourly rollup (:mod:`billing.usage_rollup`,
kept in the ledger insert's transaction, so it is exact); the partial hours at
either edge (at most one each) from the ledger rows themselves. The parts are
``UNION ALL``-ed, bucketed (``date_trunc(unit, timezone('UTC', at))`` on
PostgreSQL, ``strftime`` on SQLite: a UTC day is the sum of its UTC hours) and
grouped. A month of a busy tenant is ~720 x groups rollup rows, however many
requests it made; no per-process cache is needed. JIT is switched off on
PostgreSQL: compiling costs more than these short aggregates save.

Token layers (a partition of every token the tenant sent or received):

    semantic     prompt + completion tokens of requests answered by the semantic cache
    cached       cached prompt tokens of engine requests (prefix cache hits); of them
                 ``tier_host_cached_tokens`` / ``tier_shared_cached_tokens`` were
                 loaded from a worker's host KV tier / the shared KV tier (the rest
                 were resident in the engine's pool)
    uncached     prompt - cached tokens of engine requests
    output       completion tokens of engine requests

``input_tokens`` / ``input_cached_tokens`` / ``output_tokens`` follow OpenAI's
usage object over *all* requests (what the tenant was told per request); the
semantic figures are a subset of them.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, fields
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import (
    ColumnElement,
    DateTime,
    Select,
    Subquery,
    case,
    func,
    literal,
    select,
    text,
    union_all,
)
from sqlalchemy.orm import Session

from billing.models import NO_API_KEY, ServedBy, UsageHourly, UsageRecord


class BucketWidth(enum.StrEnum):
    HOUR = "1h"
    DAY = "1d"

    @property
    def delta(self) -> timedelta:
        return timedelta(hours=1) if self is BucketWidth.HOUR else timedelta(days=1)


class GroupBy(enum.StrEnum):
    MODEL = "model"
    API_KEY = "api_key"
    TENANT = "tenant"


@dataclass(frozen=True)
class UsageQuery:
    """What to aggregate: ``[start, end)``, optional buckets, groups and tenant scope.

    ``tenant_id=None`` means every tenant (operator views only).
    """

    start: datetime
    end: datetime
    tenant_id: int | None
    width: BucketWidth | None = None
    group_by: tuple[GroupBy, ...] = ()

    def __post_init__(self) -> None:
        for moment in (self.start, self.end):
            if moment.tzinfo is None:
                raise ValueError("usage query times must be aware (UTC)")
        if self.end < self.start:
            raise ValueError("usage query end is before its start")


@dataclass(frozen=True)
class UsageTotals:
    """Sums over a set of ledger rows (money in picodollars)."""

    num_requests: int = 0
    semantic_requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    semantic_prompt_tokens: int = 0
    semantic_cached_tokens: int = 0
    semantic_completion_tokens: int = 0
    billed_pico: int = 0
    list_pico: int = 0
    tier_host_cached_tokens: int = 0
    tier_shared_cached_tokens: int = 0

    def __add__(self, other: UsageTotals) -> UsageTotals:
        return UsageTotals(
            *(getattr(self, f.name) + getattr(other, f.name) for f in fields(UsageTotals))
        )

    @property
    def semantic_tokens(self) -> int:
        return self.semantic_prompt_tokens + self.semantic_completion_tokens

    @property
    def engine_requests(self) -> int:
        return self.num_requests - self.semantic_requests

    @property
    def engine_prompt_tokens(self) -> int:
        return self.prompt_tokens - self.semantic_prompt_tokens

    @property
    def engine_cached_tokens(self) -> int:
        return self.cached_tokens - self.semantic_cached_tokens

    @property
    def engine_uncached_tokens(self) -> int:
        return self.engine_prompt_tokens - self.engine_cached_tokens

    @property
    def engine_output_tokens(self) -> int:
        return self.completion_tokens - self.semantic_completion_tokens

    @property
    def savings_pico(self) -> int:
        return self.list_pico - self.billed_pico

    @property
    def semantic_hit_rate(self) -> float:
        """Share of requests answered by the semantic cache (display only)."""
        return self.semantic_requests / self.num_requests if self.num_requests else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        """Share of engine prompt tokens served from the prefix cache (display only)."""
        prompt = self.engine_prompt_tokens
        return self.engine_cached_tokens / prompt if prompt else 0.0


@dataclass(frozen=True)
class UsageRow:
    """One group: its bucket start (if bucketed), its group keys, its sums."""

    bucket_start: datetime | None
    tenant_id: int | None
    model: str | None
    api_key_id: str | None
    totals: UsageTotals


def _aggregates(source: Subquery) -> list[ColumnElement[Any]]:
    """Columns in the order of :class:`UsageTotals`' fields."""
    c = source.c
    semantic = c.served_by == ServedBy.SEMANTIC

    def semantic_sum(value: Any) -> ColumnElement[Any]:
        return func.sum(case((semantic, value), else_=0))

    return [
        func.sum(c.num_requests),
        semantic_sum(c.num_requests),
        func.sum(c.prompt_tokens),
        func.sum(c.cached_tokens),
        func.sum(c.completion_tokens),
        semantic_sum(c.prompt_tokens),
        semantic_sum(c.cached_tokens),
        semantic_sum(c.completion_tokens),
        func.sum(c.billed_pico),
        func.sum(c.list_pico),
        func.sum(c.tier_host_cached_tokens),
        func.sum(c.tier_shared_cached_tokens),
    ]


def bucket_expression(dialect: str, width: BucketWidth, at: Any) -> ColumnElement[Any]:
    """SQL for the UTC start of the bucket of timestamp ``at`` (naive UTC or text)."""
    if dialect == "postgresql":
        unit = "hour" if width is BucketWidth.HOUR else "day"
        return func.date_trunc(unit, func.timezone("UTC", at), type_=DateTime())
    if dialect == "sqlite":
        pattern = "%Y-%m-%d %H:00:00" if width is BucketWidth.HOUR else "%Y-%m-%d 00:00:00"
        return func.strftime(pattern, at)
    raise ValueError(f"unsupported database dialect {dialect!r}")


def _as_utc(value: Any) -> datetime:
    moment = datetime.fromisoformat(value) if isinstance(value, str) else value
    if not isinstance(moment, datetime):
        raise RuntimeError(f"unexpected bucket value {value!r}")
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)


def bucket_floor(moment: datetime, width: BucketWidth) -> datetime:
    """The UTC start of the bucket holding ``moment``."""
    step = int(width.delta.total_seconds())
    return datetime.fromtimestamp(int(moment.timestamp()) // step * step, UTC)


def _rollup_part(query: UsageQuery, start: datetime, end: datetime) -> Select[Any]:
    """Rollup rows of the whole hours ``[start, end)``."""
    h = UsageHourly
    columns: list[Any] = [
        h.tenant_id, h.model, func.nullif(h.api_key_id, NO_API_KEY).label("api_key_id"),
        h.served_by, h.hour.label("at"), h.num_requests, h.prompt_tokens, h.cached_tokens,
        h.completion_tokens, h.billed_pico, h.list_pico, h.tier_host_cached_tokens,
        h.tier_shared_cached_tokens,
    ]
    stmt = select(*columns).where(h.hour >= start, h.hour < end)
    return stmt if query.tenant_id is None else stmt.where(h.tenant_id == query.tenant_id)


def _ledger_part(query: UsageQuery, start: datetime, end: datetime) -> Select[Any]:
    """Ledger rows of ``[start, end)``, one request each."""
    r = UsageRecord
    columns: list[Any] = [
        r.tenant_id, r.model, r.api_key_id, r.served_by, r.created_at.label("at"),
        literal(1).label("num_requests"), r.prompt_tokens, r.cached_tokens,
        r.completion_tokens, r.billed_pico, r.list_pico,
        func.coalesce(r.tier_host_cached_tokens, 0).label("tier_host_cached_tokens"),
        func.coalesce(r.tier_shared_cached_tokens, 0).label("tier_shared_cached_tokens"),
    ]
    stmt = select(*columns).where(r.created_at >= start, r.created_at < end)
    return stmt if query.tenant_id is None else stmt.where(r.tenant_id == query.tenant_id)


def _source(query: UsageQuery, from_ledger: bool) -> Subquery:
    """The rows to aggregate: rollup for the whole hours, ledger for the edges."""
    first = bucket_floor(query.start, BucketWidth.HOUR)
    if first < query.start:
        first += BucketWidth.HOUR.delta
    last = bucket_floor(query.end, BucketWidth.HOUR)
    if from_ledger or first >= last:
        return _ledger_part(query, query.start, query.end).subquery("u")
    parts = [_rollup_part(query, first, last)]
    parts += [
        _ledger_part(query, lo, hi) for lo, hi in ((query.start, first), (last, query.end))
        if lo < hi
    ]
    return union_all(*parts).subquery("u")


def _group_columns(query: UsageQuery, dialect: str, source: Subquery) -> list[Any]:
    columns: list[Any] = []
    if query.width is not None:
        columns.append(bucket_expression(dialect, query.width, source.c.at).label("bucket"))
    by_name = {GroupBy.TENANT: "tenant_id", GroupBy.MODEL: "model", GroupBy.API_KEY: "api_key_id"}
    return columns + [source.c[by_name[g]] for g in GroupBy if g in query.group_by]


def build_statement(query: UsageQuery, dialect: str, *, from_ledger: bool = False) -> Select[Any]:
    """The aggregate ``SELECT`` for ``query`` (exposed for EXPLAIN in benchmarks).

    ``from_ledger`` reads every ledger row instead of the rollup (a benchmark peer).
    """
    source = _source(query, from_ledger)
    keys = _group_columns(query, dialect, source)
    stmt = select(*keys, *_aggregates(source))
    if keys:
        stmt = stmt.group_by(*keys).order_by(*keys)
    return stmt


def aggregate_usage(
    session: Session, query: UsageQuery, *, from_ledger: bool = False
) -> list[UsageRow]:
    """Run ``query``; rows ordered by bucket then group keys. No rows, no groups."""
    if query.start == query.end:
        return []
    dialect = session.get_bind().dialect.name
    num_keys = len(query.group_by) + (query.width is not None)
    if dialect == "postgresql":
        # JIT compilation costs more than these short aggregates ever save.
        session.execute(text("SET LOCAL jit = off"))
    result: list[UsageRow] = []
    for row in session.execute(build_statement(query, dialect, from_ledger=from_ledger)):
        values = tuple(row)
        totals = UsageTotals(*(int(v or 0) for v in values[num_keys:]))
        if totals.num_requests == 0:
            continue
        keys = list(values[:num_keys])
        bucket = _as_utc(keys.pop(0)) if query.width is not None else None
        named = dict(zip([g for g in GroupBy if g in query.group_by], keys, strict=True))
        result.append(
            UsageRow(
                bucket_start=bucket,
                tenant_id=named.get(GroupBy.TENANT),
                model=named.get(GroupBy.MODEL),
                api_key_id=named.get(GroupBy.API_KEY),
                totals=totals,
            )
        )
    return result


def total_usage(session: Session, query: UsageQuery) -> UsageTotals:
    """Sums over the whole of ``query``'s range and scope (buckets and groups ignored)."""
    flat = UsageQuery(start=query.start, end=query.end, tenant_id=query.tenant_id)
    rows = aggregate_usage(session, flat)
    return rows[0].totals if rows else UsageTotals()


def sum_rows(rows: Sequence[UsageRow]) -> UsageTotals:
    """The totals of several rows added up."""
    total = UsageTotals()
    for row in rows:
        total = total + row.totals
    return total
