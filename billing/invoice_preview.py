"""Invoice preview: the open month's lines as they stand, read-only and unnumbered.

The preview shows what closing the current UTC month (:func:`billing.invoices.close_period`)
would bill if it ran now, built with the same line rules from the same ledger rows:
the tenant's *uninvoiced* rows created in the month so far, plus late rows of
months that are already closed (those go into the next invoice closed). Rows of an
earlier month that has not been closed yet are left out: they belong to that
month's own invoice. Nothing is written: no invoice row, no number, no ledger row
tagged, so a closed invoice never changes and the preview can be asked any time.
Its ``status`` is ``draft`` and its ``id`` is ``null``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import ColumnElement, func, or_, select
from sqlalchemy.orm import Session

from billing.invoice_export import DocumentLine, InvoiceTotals, totals_json
from billing.invoices import Period, ledger_sums, line_drafts, parse_period
from billing.models import Invoice, Tenant, UsageRecord

DRAFT = "draft"


@dataclass(frozen=True, kw_only=True)
class InvoicePreview(InvoiceTotals):
    """The open month of one tenant, as it stands at ``as_of`` (money in picodollars)."""

    as_of: datetime


def open_period(now: datetime) -> Period:
    """The UTC calendar month containing ``now``."""
    return parse_period(f"{now.astimezone(UTC):%Y-%m}")


def _preview_rows(session: Session, tenant_id: int, period: Period) -> list[ColumnElement[bool]]:
    """Conditions selecting the rows the period's invoice would take (module doc)."""
    r = UsageRecord
    latest = session.scalar(select(func.max(Invoice.period)).where(Invoice.tenant_id == tenant_id))
    in_month: ColumnElement[bool] = r.created_at >= period.start
    if latest is not None:
        in_month = or_(in_month, r.created_at < parse_period(latest).end)
    return [r.tenant_id == tenant_id, r.invoice_id.is_(None), r.created_at < period.end, in_month]


def preview_invoice(
    session: Session, tenant: Tenant, now: datetime | None = None
) -> InvoicePreview:
    """The draft invoice of ``tenant``'s open month (read-only; see the module doc)."""
    moment = (now or datetime.now(UTC)).astimezone(UTC)
    period = open_period(moment)
    where = _preview_rows(session, tenant.id, period)
    lines = tuple(
        DocumentLine(d.model, d.kind.value, d.quantity, d.unit_pico, d.amount_pico, d.list_pico)
        for d in line_drafts(session, *where)
    )
    billed, listed = ledger_sums(session, *where)
    if sum(line.amount_pico for line in lines) != billed:
        raise RuntimeError(f"invoice preview of {tenant.name}: lines do not add up")
    return InvoicePreview(tenant_name=tenant.name, period=period.label, as_of=moment,
                          total_pico=billed, list_pico=listed, lines=lines)


def preview_payload(preview: InvoicePreview) -> dict[str, object]:
    """The preview in the shape of an exported invoice, marked ``draft``, ``id`` null."""
    return {
        "object": "invoice",
        "id": None,
        "tenant": preview.tenant_name,
        "period": preview.period,
        "status": DRAFT,
        "as_of": preview.as_of.isoformat(),
        "closed_at": None,
        **totals_json(preview),
    }


def preview_json(preview: InvoicePreview) -> str:
    """:func:`preview_payload` as indented JSON text."""
    return json.dumps(preview_payload(preview), indent=2) + "\n"
