"""Invoices: close a tenant's billing period into an immutable invoice.

Algorithm (one transaction per tenant and period ``P = [start, end)``):

1. If the tenant already has an invoice for ``P``, return it unchanged (idempotent).
2. Refuse a period that has not ended yet, or one older than the tenant's latest
   invoice (its usage was already swept into that later invoice).
3. Insert the invoice row, then tag it onto every *uninvoiced* ledger row of the
   tenant created before ``end``: the period's own usage plus late usage of
   earlier, already-closed periods (rows recorded after those were closed).
   A tagged row never changes invoice again, so a closed invoice never changes.
4. Build lines from the tagged rows, per model and kind, from the price each row
   was rated with (:mod:`billing.rating` is linear per token for engine requests):

       uncached_input  (prompt - cached) tokens x input price
       cached_input    cached tokens x cached-input price   (list: x input price)
       output          completion tokens x output price
       semantic_hit    prompt + completion tokens of semantic hits; amount = the
                       ledger's billed sum (each hit was rounded once when rated)
       adjustment      whatever the ledger billed that the price does not explain
                       (rows without a price, or rated by other rules)

   ``unit_pico`` is the per-token price, or 0 when a line mixes several prices.
5. Totals are the ledger's own sums over the tagged rows; the lines add up to them
   exactly (checked; a mismatch is a ``RuntimeError``).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import ColumnElement, func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from billing.errors import Conflict, InvalidInput, NotFound
from billing.models import (
    Invoice,
    InvoiceLine,
    InvoiceStatus,
    Price,
    ServedBy,
    Tenant,
    UsageRecord,
)

PERIOD_RE = re.compile(r"(\d{4})-(0[1-9]|1[0-2])")


class LineKind(enum.StrEnum):
    UNCACHED_INPUT = "uncached_input"
    CACHED_INPUT = "cached_input"
    SEMANTIC_HIT = "semantic_hit"
    OUTPUT = "output"
    ADJUSTMENT = "adjustment"


KIND_ORDER = {kind: i for i, kind in enumerate(LineKind)}


@dataclass(frozen=True)
class Period:
    """A calendar month in UTC."""

    year: int
    month: int

    @property
    def label(self) -> str:
        return f"{self.year:04d}-{self.month:02d}"

    @property
    def start(self) -> datetime:
        return datetime(self.year, self.month, 1, tzinfo=UTC)

    @property
    def end(self) -> datetime:
        if self.month == 12:
            return datetime(self.year + 1, 1, 1, tzinfo=UTC)
        return datetime(self.year, self.month + 1, 1, tzinfo=UTC)


def parse_period(text: str) -> Period:
    """``"YYYY-MM"`` to a :class:`Period`; :class:`InvalidInput` otherwise."""
    match = PERIOD_RE.fullmatch(text.strip()) if isinstance(text, str) else None
    if match is None or int(match.group(1)) < 1970:
        raise InvalidInput(f"invalid period {text!r}: expected YYYY-MM (e.g. 2026-01)")
    return Period(int(match.group(1)), int(match.group(2)))


@dataclass(frozen=True)
class LineDraft:
    """One invoice line before it is stored (money in picodollars)."""

    model: str
    kind: LineKind
    quantity: int
    unit_pico: int
    amount_pico: int
    list_pico: int


@dataclass(frozen=True)
class _Group:
    """Ledger sums for one (model, price, served_by) group of an invoice's rows."""

    model: str
    served_by: ServedBy
    price: Price | None
    prompt: int
    cached: int
    completion: int
    billed: int
    listed: int


def _group_drafts(group: _Group) -> list[LineDraft]:
    m, p = group.model, group.price
    if group.served_by == ServedBy.SEMANTIC:
        qty = group.prompt + group.completion
        return [LineDraft(m, LineKind.SEMANTIC_HIT, qty, 0, group.billed, group.listed)]
    uncached = group.prompt - group.cached
    in_p, cached_p, out_p = (
        (p.input_pico, p.cached_input_pico, p.output_pico) if p is not None else (0, 0, 0)
    )
    drafts = [
        LineDraft(m, LineKind.UNCACHED_INPUT, uncached, in_p, uncached * in_p, uncached * in_p),
        LineDraft(
            m, LineKind.CACHED_INPUT, group.cached, cached_p, group.cached * cached_p,
            group.cached * in_p,
        ),
        LineDraft(
            m, LineKind.OUTPUT, group.completion, out_p, group.completion * out_p,
            group.completion * out_p,
        ),
    ]
    billed_gap = group.billed - sum(d.amount_pico for d in drafts)
    list_gap = group.listed - sum(d.list_pico for d in drafts)
    if billed_gap or list_gap:
        drafts.append(LineDraft(m, LineKind.ADJUSTMENT, 0, 0, billed_gap, list_gap))
    return drafts


def merge_drafts(drafts: Sequence[LineDraft]) -> list[LineDraft]:
    """Merge drafts per (model, kind); mixed unit prices give ``unit_pico`` 0."""
    merged: dict[tuple[str, LineKind], LineDraft] = {}
    for d in drafts:
        seen = merged.get((d.model, d.kind))
        if seen is None:
            merged[(d.model, d.kind)] = d
            continue
        merged[(d.model, d.kind)] = LineDraft(
            d.model,
            d.kind,
            seen.quantity + d.quantity,
            seen.unit_pico if seen.unit_pico == d.unit_pico else 0,
            seen.amount_pico + d.amount_pico,
            seen.list_pico + d.list_pico,
        )
    kept = [d for d in merged.values() if d.quantity or d.amount_pico or d.list_pico]
    return sorted(kept, key=lambda d: (d.model, KIND_ORDER[d.kind]))


def _load_groups(session: Session, *where: ColumnElement[bool]) -> list[_Group]:
    r = UsageRecord
    stmt = (
        select(
            r.model, r.served_by, r.price_id,
            func.sum(r.prompt_tokens), func.sum(r.cached_tokens), func.sum(r.completion_tokens),
            func.sum(r.billed_pico), func.sum(r.list_pico),
        )
        .where(*where)
        .group_by(r.model, r.served_by, r.price_id)
    )
    rows = session.execute(stmt).all()
    price_ids = {row[2] for row in rows if row[2] is not None}
    prices = {p.id: p for p in session.scalars(select(Price).where(Price.id.in_(price_ids)))}
    return [
        _Group(
            model=row[0], served_by=ServedBy(row[1]),
            price=prices.get(row[2]) if row[2] is not None else None,
            prompt=int(row[3]), cached=int(row[4]), completion=int(row[5]),
            billed=int(row[6]), listed=int(row[7]),
        )
        for row in rows
    ]


def ledger_sums(session: Session, *where: ColumnElement[bool]) -> tuple[int, int]:
    """``(billed, list)`` picodollar sums of the ledger rows matching ``where``."""
    r = UsageRecord
    stmt = select(
        func.coalesce(func.sum(r.billed_pico), 0), func.coalesce(func.sum(r.list_pico), 0)
    )
    billed, listed = session.execute(stmt.where(*where)).one()
    return int(billed), int(listed)


def line_drafts(session: Session, *where: ColumnElement[bool]) -> list[LineDraft]:
    """The merged invoice lines of the ledger rows matching ``where`` (step 4 above)."""
    return merge_drafts([d for g in _load_groups(session, *where) for d in _group_drafts(g)])


def find_invoice(session: Session, tenant_id: int, period: Period) -> Invoice | None:
    """The tenant's invoice for ``period``, if it was closed."""
    stmt = select(Invoice).where(Invoice.tenant_id == tenant_id, Invoice.period == period.label)
    return session.scalars(stmt).first()


def _check_closable(session: Session, tenant: Tenant, period: Period, now: datetime) -> None:
    if period.end > now:
        raise InvalidInput(f"period {period.label} has not ended yet (ends {period.end:%Y-%m-%d})")
    latest = session.scalar(select(func.max(Invoice.period)).where(Invoice.tenant_id == tenant.id))
    if latest is not None and latest > period.label:
        raise Conflict(
            f"tenant {tenant.name!r} already has an invoice for the later period {latest};"
            f" usage of {period.label} was included there"
        )


def close_period(
    session: Session, tenant: Tenant, period: Period, now: datetime | None = None
) -> Invoice:
    """Close ``period`` for ``tenant`` (see the module algorithm); flushes, caller commits."""
    moment = now or datetime.now(UTC)
    existing = find_invoice(session, tenant.id, period)
    if existing is not None:
        return existing
    _check_closable(session, tenant, period, moment)
    invoice = Invoice(
        tenant_id=tenant.id, period=period.label, status=InvoiceStatus.CLOSED,
        total_pico=0, list_pico=0, closed_at=moment,
    )
    try:
        with session.begin_nested():
            session.add(invoice)
    except IntegrityError:  # closed concurrently by another process
        found = find_invoice(session, tenant.id, period)
        if found is None:
            raise
        return found
    _tag_rows(session, tenant.id, invoice.id, period.end)
    _write_lines(session, invoice)
    return invoice


def _tag_rows(session: Session, tenant_id: int, invoice_id: int, end: datetime) -> None:
    r = UsageRecord
    stmt = (
        update(r)
        .where(r.tenant_id == tenant_id, r.invoice_id.is_(None), r.created_at < end)
        .values(invoice_id=invoice_id)
        .execution_options(synchronize_session=False)
    )
    session.execute(stmt)


def _write_lines(session: Session, invoice: Invoice) -> None:
    tagged = UsageRecord.invoice_id == invoice.id
    drafts = line_drafts(session, tagged)
    billed, listed = ledger_sums(session, tagged)
    if sum(d.amount_pico for d in drafts) != billed or sum(d.list_pico for d in drafts) != listed:
        raise RuntimeError(f"invoice {invoice.id}: lines do not add up to the ledger")
    for d in drafts:
        session.add(
            InvoiceLine(
                invoice_id=invoice.id, model=d.model, kind=d.kind.value, quantity=d.quantity,
                unit_pico=d.unit_pico, amount_pico=d.amount_pico, list_pico=d.list_pico,
            )
        )
    invoice.total_pico, invoice.list_pico = billed, listed
    session.flush()


def tenants_to_invoice(session: Session, period: Period) -> Sequence[Tenant]:
    """Tenants that existed, or used something, before ``period`` ended, by name."""
    used = (
        select(UsageRecord.id)
        .where(UsageRecord.tenant_id == Tenant.id, UsageRecord.created_at < period.end)
        .exists()
    )
    stmt = select(Tenant).where((Tenant.created_at < period.end) | used).order_by(Tenant.name)
    return session.scalars(stmt).all()


def list_invoices(session: Session, tenant_id: int | None) -> Sequence[Invoice]:
    """Invoices, newest period first; ``tenant_id=None`` lists every tenant's."""
    stmt = select(Invoice).order_by(Invoice.period.desc(), Invoice.tenant_id)
    if tenant_id is not None:
        stmt = stmt.where(Invoice.tenant_id == tenant_id)
    return session.scalars(stmt).all()


def get_invoice(session: Session, invoice_id: int, tenant_id: int | None) -> Invoice:
    """One invoice; :class:`NotFound` if unknown or (``tenant_id`` given) not the tenant's."""
    invoice = session.get(Invoice, invoice_id)
    if invoice is None or (tenant_id is not None and invoice.tenant_id != tenant_id):
        raise NotFound(f"unknown invoice {invoice_id}")
    return invoice
