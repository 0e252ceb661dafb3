"""Invoice documents and their CSV, JSON and PDF renderings.

Amounts are shown exactly (``exact_usd``: every picodollar, trailing zeros trimmed
to cents), so an exported total always equals the ledger sum to the last digit.
"""

from __future__ import annotations

import csv
import enum
import io
import json
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import TYPE_CHECKING

from sqlalchemy.orm import Session

from billing.invoices import get_invoice
from billing.models import Invoice, Tenant
from billing.money import exact_usd as exact_usd  # re-exported: it lived here first
from billing.money import price_per_1m_usd

if TYPE_CHECKING:
    from fpdf import FPDF

KIND_LABELS = {
    "uncached_input": "Input tokens (uncached)",
    "cached_input": "Input tokens (prefix cache)",
    "semantic_hit": "Semantic cache hits (tokens)",
    "output": "Output tokens",
    "adjustment": "Adjustment",
}


class ExportFormat(enum.StrEnum):
    CSV = "csv"
    JSON = "json"
    PDF = "pdf"

    @property
    def media_type(self) -> str:
        return {"csv": "text/csv", "json": "application/json", "pdf": "application/pdf"}[self]


@dataclass(frozen=True)
class DocumentLine:
    model: str
    kind: str
    quantity: int
    unit_pico: int
    amount_pico: int
    list_pico: int

    @property
    def unit_per_1m(self) -> Decimal | None:
        """USD per 1M tokens, or ``None`` when the line mixes prices or has none."""
        return price_per_1m_usd(self.unit_pico) if self.unit_pico else None


@dataclass(frozen=True, kw_only=True)
class InvoiceTotals:
    """What every invoice shows, closed or draft: whose, which month, the lines and
    their totals (picodollars), detached from the session."""

    tenant_name: str
    period: str
    total_pico: int
    list_pico: int
    lines: tuple[DocumentLine, ...]

    @property
    def savings_pico(self) -> int:
        return self.list_pico - self.total_pico


@dataclass(frozen=True, kw_only=True)
class InvoiceDocument(InvoiceTotals):
    """A closed invoice as every export shows it: its number, status and closing time."""

    invoice_id: int
    status: str
    closed_at: datetime

    @property
    def filename_stem(self) -> str:
        return f"kvtoll-invoice-{self.invoice_id}-{self.period}"


def document_of(invoice: Invoice, tenant: Tenant) -> InvoiceDocument:
    """Detach ``invoice`` (with its lines) into a document."""
    lines = tuple(
        DocumentLine(
            line.model, line.kind, line.quantity, line.unit_pico, line.amount_pico, line.list_pico
        )
        for line in invoice.lines
    )
    return InvoiceDocument(
        invoice_id=invoice.id, tenant_name=tenant.name, period=invoice.period,
        status=invoice.status.value, closed_at=invoice.closed_at,
        total_pico=invoice.total_pico, list_pico=invoice.list_pico, lines=lines,
    )


def load_document(session: Session, invoice_id: int, tenant_id: int | None) -> InvoiceDocument:
    """The document of one invoice; :class:`NotFound` if not visible to ``tenant_id``."""
    invoice = get_invoice(session, invoice_id, tenant_id)
    tenant = session.get(Tenant, invoice.tenant_id)
    if tenant is None:
        raise RuntimeError(f"invoice {invoice_id} has no tenant")
    return document_of(invoice, tenant)


def _unit_text(line: DocumentLine) -> str | None:
    return None if line.unit_per_1m is None else str(line.unit_per_1m)


def to_json(doc: InvoiceDocument) -> str:
    """JSON with exact decimal strings (``*_usd``) and integer picodollars (``*_pico``)."""
    payload = {
        "object": "invoice",
        "id": doc.invoice_id,
        "tenant": doc.tenant_name,
        "period": doc.period,
        "status": doc.status,
        "closed_at": doc.closed_at.isoformat(),
        **totals_json(doc),
    }
    return json.dumps(payload, indent=2) + "\n"


def totals_json(totals: InvoiceTotals) -> dict[str, object]:
    """The money of an invoice, closed or draft: exact strings, picodollars, lines."""
    return {
        "currency": "usd",
        "total_usd": exact_usd(totals.total_pico),
        "list_usd": exact_usd(totals.list_pico),
        "savings_usd": exact_usd(totals.savings_pico),
        "total_pico": totals.total_pico,
        "list_pico": totals.list_pico,
        "lines": [line_json(line) for line in totals.lines],
    }


def line_json(line: DocumentLine) -> dict[str, object]:
    """One invoice line as JSON: exact decimal strings and integer picodollars."""
    return {
        "model": line.model,
        "kind": line.kind,
        "quantity": line.quantity,
        "unit_price_usd_per_1m": _unit_text(line),
        "amount_usd": exact_usd(line.amount_pico),
        "list_usd": exact_usd(line.list_pico),
        "savings_usd": exact_usd(line.list_pico - line.amount_pico),
        "amount_pico": line.amount_pico,
        "list_pico": line.list_pico,
    }


CSV_HEADER = (
    "invoice_id", "tenant", "period", "model", "kind", "quantity",
    "unit_price_usd_per_1m", "amount_usd", "list_usd", "savings_usd",
)


def to_csv(doc: InvoiceDocument) -> str:
    """One row per line, then a ``TOTAL`` row."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(CSV_HEADER)
    head = (doc.invoice_id, doc.tenant_name, doc.period)
    for line in doc.lines:
        unit = "" if line.unit_per_1m is None else str(line.unit_per_1m)
        writer.writerow((
            *head, line.model, line.kind, line.quantity, unit, exact_usd(line.amount_pico),
            exact_usd(line.list_pico), exact_usd(line.list_pico - line.amount_pico),
        ))
    writer.writerow((
        *head, "", "TOTAL", "", "", exact_usd(doc.total_pico), exact_usd(doc.list_pico),
        exact_usd(doc.savings_pico),
    ))
    return out.getvalue()


def _latin1(text: str) -> str:
    """Core PDF fonts are Latin-1: replace anything else rather than fail."""
    return text.encode("latin-1", "replace").decode("latin-1")


PDF_COLUMNS = (("Model", 46), ("Item", 50), ("Tokens", 26), ("$ / 1M", 20), ("Amount $", 38))


def _pdf_table(pdf: FPDF, doc: InvoiceDocument) -> None:
    pdf.set_font("Helvetica", "B", 9)
    for title, width in PDF_COLUMNS:
        pdf.cell(width, 7, title, border="B")
    pdf.ln()
    pdf.set_font("Helvetica", "", 9)
    for line in doc.lines:
        unit = "-" if line.unit_per_1m is None else str(line.unit_per_1m)
        cells = (
            _latin1(line.model)[:28], KIND_LABELS.get(line.kind, line.kind), f"{line.quantity:,}",
            unit, exact_usd(line.amount_pico),
        )
        for (_, width), text in zip(PDF_COLUMNS, cells, strict=True):
            pdf.cell(width, 6, text)
        pdf.ln()


def to_pdf(doc: InvoiceDocument) -> bytes:
    """A one-page (or more) A4 invoice with lines, total, list price and savings."""
    from fpdf import FPDF  # here, not at the top: 0.5 s of every gateway's start otherwise

    pdf = FPDF(format="A4")
    pdf.set_title(f"kvtoll invoice {doc.invoice_id}")
    pdf.add_page()
    pdf.set_font("Helvetica", "B", 16)
    pdf.cell(0, 10, f"Invoice #{doc.invoice_id}", new_x="LMARGIN", new_y="NEXT")
    pdf.set_font("Helvetica", "", 10)
    for text in (
        f"Tenant: {_latin1(doc.tenant_name)}",
        f"Period: {doc.period} (UTC)",
        f"Status: {doc.status}, closed {doc.closed_at:%Y-%m-%d %H:%M} UTC",
    ):
        pdf.cell(0, 6, text, new_x="LMARGIN", new_y="NEXT")
    pdf.ln(4)
    _pdf_table(pdf, doc)
    pdf.ln(4)
    pdf.set_font("Helvetica", "B", 11)
    for label, pico in (
        ("List price", doc.list_pico),
        ("Savings from caching", doc.savings_pico),
        ("Total due (USD)", doc.total_pico),
    ):
        pdf.cell(0, 7, f"{label}: {exact_usd(pico)}", new_x="LMARGIN", new_y="NEXT")
    return bytes(pdf.output())


def render(doc: InvoiceDocument, fmt: ExportFormat) -> bytes:
    """The document in ``fmt`` as bytes (UTF-8 for text formats)."""
    if fmt is ExportFormat.PDF:
        return to_pdf(doc)
    return (to_json(doc) if fmt is ExportFormat.JSON else to_csv(doc)).encode()
