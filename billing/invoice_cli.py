"""``kvtoll invoice ...``: close billing periods and export invoices.

    kvtoll invoice generate --period YYYY-MM [--tenant NAME]
    kvtoll invoice list [--tenant NAME]
    kvtoll invoice preview --tenant NAME [--json]
    kvtoll invoice export ID --format csv|json|pdf -o FILE

Caller mistakes print one line and exit 2 with nothing written.
"""

from __future__ import annotations

from pathlib import Path

import typer
from sqlalchemy import select

from billing.accounts import require_tenant
from billing.cli_support import session as open_session
from billing.errors import BillingError
from billing.invoice_export import KIND_LABELS, ExportFormat, exact_usd, load_document, render
from billing.invoice_preview import InvoicePreview, preview_invoice, preview_json
from billing.invoices import close_period, list_invoices, parse_period, tenants_to_invoice
from billing.models import Invoice, Tenant
from kvtoll.cli.errors import fail

MAX_INVOICE_ID = 2**63 - 1  # the widest id column (PostgreSQL bigint)


def _describe(invoice: Invoice, tenant_name: str) -> str:
    return (
        f"invoice {invoice.id}  tenant={tenant_name}  period={invoice.period}"
        f"  total_usd={exact_usd(invoice.total_pico)}  list_usd={exact_usd(invoice.list_pico)}"
        f"  savings_usd={exact_usd(invoice.list_pico - invoice.total_pico)}"
    )


def generate(
    period: str = typer.Option(..., "--period", help="billing month, YYYY-MM (UTC)"),
    tenant: str | None = typer.Option(None, "--tenant", help="only this tenant"),
) -> None:
    """Close PERIOD (idempotent: a closed invoice is returned unchanged)."""
    try:
        month = parse_period(period)
        with open_session() as session:
            tenants: list[Tenant] = (
                [require_tenant(session, tenant)]
                if tenant is not None
                else list(tenants_to_invoice(session, month))
            )
            if not tenants:
                typer.echo(f"no tenant existed or used anything before {month.label} ended")
            for row in tenants:
                invoice = close_period(session, row, month)
                session.commit()
                typer.echo(_describe(invoice, row.name))
    except BillingError as exc:
        fail(str(exc))


def list_command(
    tenant: str | None = typer.Option(None, "--tenant", help="only this tenant"),
) -> None:
    """List closed invoices, newest period first."""
    try:
        with open_session() as session:
            tenant_id = require_tenant(session, tenant).id if tenant is not None else None
            names = dict(session.execute(select(Tenant.id, Tenant.name)).tuples().all())
            for invoice in list_invoices(session, tenant_id):
                typer.echo(_describe(invoice, names.get(invoice.tenant_id, "?")))
    except BillingError as exc:
        fail(str(exc))


def _preview_text(preview: InvoicePreview) -> str:
    head = (
        f"invoice preview  tenant={preview.tenant_name}  period={preview.period}  status=draft"
        f"  as_of={preview.as_of.isoformat(timespec='seconds')}"
        f"  total_usd={exact_usd(preview.total_pico)}  list_usd={exact_usd(preview.list_pico)}"
        f"  savings_usd={exact_usd(preview.savings_pico)}"
    )
    rows = [
        f"  {line.model}\t{KIND_LABELS.get(line.kind, line.kind)}\t{line.quantity}"
        f"\t{exact_usd(line.amount_pico)}"
        for line in preview.lines
    ]
    return "\n".join([head, *rows])


def preview(
    tenant: str = typer.Option(..., "--tenant", help="tenant name"),
    as_json: bool = typer.Option(False, "--json", help="print the draft as JSON"),
) -> None:
    """Show the open month's invoice as it stands (a draft: not numbered, not stored)."""
    try:
        with open_session() as session:
            draft = preview_invoice(session, require_tenant(session, tenant))
    except BillingError as exc:
        fail(str(exc))
    typer.echo(preview_json(draft).rstrip("\n") if as_json else _preview_text(draft))


def _parse_export_args(invoice_id: str, fmt: str) -> tuple[int, ExportFormat]:
    if not (invoice_id.isascii() and invoice_id.isdigit()) or int(invoice_id) > MAX_INVOICE_ID:
        fail(f"invalid invoice id {invoice_id!r}: expected a number up to {MAX_INVOICE_ID}")
    try:
        return int(invoice_id), ExportFormat(fmt.lower())
    except ValueError:
        fail(f"invalid format {fmt!r}: expected csv, json or pdf")


def export(
    invoice_id: str = typer.Argument(..., help="invoice id (see `kvtoll invoice list`)"),
    fmt: str = typer.Option(..., "--format", help="csv, json or pdf"),
    output: Path = typer.Option(..., "-o", "--output", help="file to write"),
) -> None:
    """Write one invoice as CSV, JSON or PDF."""
    number, kind = _parse_export_args(invoice_id, fmt)
    try:
        with open_session() as session:
            data = render(load_document(session, number, None), kind)
    except BillingError as exc:
        fail(str(exc))
    try:
        output.write_bytes(data)
    except OSError as exc:
        fail(f"cannot write {output}: {exc.strerror or exc}")
    typer.echo(f"wrote {output} ({len(data)} bytes)")


def register(app: typer.Typer) -> None:
    """Attach the ``invoice`` command group to the root CLI."""
    group = typer.Typer(help="Close billing periods and export invoices.", no_args_is_help=True)
    group.command("generate")(generate)
    group.command("list")(list_command)
    group.command("preview")(preview)
    group.command("export")(export)
    app.add_typer(group, name="invoice")
