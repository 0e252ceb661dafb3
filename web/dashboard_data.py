"""Template contexts of the tenant and admin dashboards (plain data, no web framework).

Figures come from :mod:`billing.usage` (SQL aggregates) and are formatted here:
money exactly (:func:`billing.invoice_export.exact_usd`), rates as percentages.
Chart series are handed to the page as JSON and drawn by Chart.js in the browser.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from billing.budgets import BudgetStatus, budget_statuses
from billing.invoice_export import KIND_LABELS, exact_usd
from billing.invoice_preview import InvoicePreview, preview_invoice
from billing.invoices import list_invoices
from billing.models import ApiKey, Invoice, Tenant
from billing.money import ppm_to_fraction
from billing.usage import (
    BucketWidth,
    GroupBy,
    UsageQuery,
    UsageRow,
    UsageTotals,
    aggregate_usage,
    sum_rows,
)

TOP_SPENDERS = 10
FORMATS = ("pdf", "csv", "json")
_BOTH = (GroupBy.MODEL, GroupBy.API_KEY)
WorkerRows = Sequence[Mapping[str, object]]


def percent(rate: float) -> str:
    return f"{rate * 100:.1f}%"


def totals_view(t: UsageTotals) -> dict[str, Any]:
    """Every figure a summary card or table row shows."""
    return {
        "requests": t.num_requests,
        "input_tokens": t.prompt_tokens,
        "cached_tokens": t.cached_tokens,
        "output_tokens": t.completion_tokens,
        "semantic_requests": t.semantic_requests,
        "semantic_tokens": t.semantic_tokens,
        "engine_cached_tokens": t.engine_cached_tokens,
        "tier_host_cached_tokens": t.tier_host_cached_tokens,
        "tier_shared_cached_tokens": t.tier_shared_cached_tokens,
        "engine_uncached_tokens": t.engine_uncached_tokens,
        "engine_output_tokens": t.engine_output_tokens,
        "billed": exact_usd(t.billed_pico),
        "list": exact_usd(t.list_pico),
        "savings": exact_usd(t.savings_pico),
        "semantic_hit_rate": percent(t.semantic_hit_rate),
        "prefix_hit_rate": percent(t.prefix_hit_rate),
    }


def chart_width(start: datetime, end: datetime) -> BucketWidth:
    return BucketWidth.HOUR if end - start <= timedelta(days=2) else BucketWidth.DAY


def series(rows: Sequence[UsageRow], start: datetime, end: datetime, width: BucketWidth) -> dict:
    """Per-bucket chart series over ``[start, end)``, empty buckets included."""
    by_start = {row.bucket_start: row.totals for row in rows}
    labels: list[str] = []
    points: list[UsageTotals] = []
    cursor = start
    while cursor < end:
        labels.append(cursor.strftime("%m-%d %H:00" if width is BucketWidth.HOUR else "%Y-%m-%d"))
        points.append(by_start.get(cursor, UsageTotals()))
        cursor += width.delta
    return {
        "labels": labels,
        "requests": [p.num_requests for p in points],
        "semantic": [p.semantic_tokens for p in points],
        "cached": [p.engine_cached_tokens for p in points],
        "uncached": [p.engine_uncached_tokens for p in points],
        "output": [p.engine_output_tokens for p in points],
        "billed": [exact_usd(p.billed_pico) for p in points],
        "list": [exact_usd(p.list_pico) for p in points],
        "semantic_rate": [round(p.semantic_hit_rate * 100, 2) for p in points],
        "prefix_rate": [round(p.prefix_hit_rate * 100, 2) for p in points],
    }


def invoice_rows(invoices: Sequence[Invoice], base: str, names: Mapping[int, str]) -> list[dict]:
    return [
        {
            "id": inv.id,
            "period": inv.period,
            "tenant": names.get(inv.tenant_id, ""),
            "total": exact_usd(inv.total_pico),
            "list": exact_usd(inv.list_pico),
            "savings": exact_usd(inv.list_pico - inv.total_pico),
            "links": {fmt: f"{base}/{inv.id}/download?format={fmt}" for fmt in FORMATS},
        }
        for inv in invoices
    ]


def preview_view(draft: InvoicePreview) -> dict[str, Any]:
    """The open month's draft invoice (lines, total, list price, savings) for a page."""
    return {
        "period": draft.period,
        "as_of": draft.as_of.strftime("%Y-%m-%d %H:%M UTC"),
        "total": exact_usd(draft.total_pico),
        "list": exact_usd(draft.list_pico),
        "savings": exact_usd(draft.savings_pico),
        "lines": [
            {"model": line.model, "kind": KIND_LABELS.get(line.kind, line.kind),
             "quantity": line.quantity, "amount": exact_usd(line.amount_pico)}
            for line in draft.lines
        ],
    }


STATE_LABELS = {"ok": "ok", "alert": "alert: past threshold", "exceeded": "limit reached"}


def budget_rows(statuses: Sequence[BudgetStatus], labels: Mapping[str, str]) -> list[dict]:
    """Budgets with this month's spend (from the ledger) for a page."""
    return [
        {
            "tenant": s.budget.tenant_name,
            "scope": "whole tenant" if s.budget.api_key_id is None
            else f"key {labels.get(s.budget.api_key_id, s.budget.api_key_id)}",
            "limit": exact_usd(s.budget.terms.limit_pico),
            "spent": exact_usd(s.spent_pico),
            "used": f"{s.budget.terms.percent_used(s.spent_pico)}%",
            "alert_at": f"{ppm_to_fraction(s.budget.terms.alert_ppm * 100)}%",
            "state": s.state,
            "state_label": STATE_LABELS[s.state],
        }
        for s in statuses
    ]


def _key_labels(session: Session, tenant_id: int) -> dict[str, str]:
    stmt = select(ApiKey.id, ApiKey.name, ApiKey.display_prefix).where(
        ApiKey.tenant_id == tenant_id
    )
    return {kid: f"{name or 'unnamed'} ({prefix}…)" for kid, name, prefix in session.execute(stmt)}


def roll_up(rows: Sequence[UsageRow], key: Callable[[UsageRow], Any]) -> dict[Any, UsageTotals]:
    """Totals of ``rows`` per ``key(row)``, in first-seen order."""
    out: dict[Any, UsageTotals] = {}
    for row in rows:
        out[key(row)] = out.get(key(row), UsageTotals()) + row.totals
    return out


def tenant_context(
    session: Session, tenant_id: int, start: datetime, end: datetime
) -> dict:
    """Everything the tenant dashboard shows for ``[start, end)``.

    One bucketed query grouped by model and key feeds the charts, the totals and
    both breakdowns.
    """
    width = chart_width(start, end)
    rows = aggregate_usage(session, UsageQuery(start, end, tenant_id, width=width, group_by=_BOTH))
    per_bucket = roll_up(rows, lambda r: r.bucket_start)
    bucketed = [UsageRow(b, None, None, None, t) for b, t in per_bucket.items()]
    labels = _key_labels(session, tenant_id)
    by_model = sorted(roll_up(rows, lambda r: r.model).items())
    by_key = roll_up(rows, lambda r: r.api_key_id or "")
    tenant = session.get(Tenant, tenant_id)
    return {
        "totals": totals_view(sum_rows(bucketed)),
        "chart": series(bucketed, start, end, width),
        "models": [{"name": model, **totals_view(t)} for model, t in by_model],
        "keys": sorted(
            ({"name": labels.get(kid, "(no key)"), **totals_view(t)} for kid, t in by_key.items()),
            key=lambda view: view["name"],
        ),
        "invoices": invoice_rows(list_invoices(session, tenant_id), "/v1/invoices", {}),
        "preview": None if tenant is None else preview_view(preview_invoice(session, tenant)),
        "budgets": budget_rows(budget_statuses(session, tenant_id), labels),
    }


WORKER_LABELS = {"name": "Worker", "worker": "Worker", "healthy": "Status", "url": "URL",
                 "kv_events": "KV events", "pending_prefill_tokens": "Pending prefill"}


def worker_label(column: str) -> str:
    """A worker-status column's header (``free_blocks`` -> ``Free blocks``)."""
    return WORKER_LABELS.get(column, column.replace("_", " ").capitalize())


def worker_cell(column: str, value: object) -> str:
    """A worker-status value in words: health as ``up``/``down``, other flags yes/no."""
    if isinstance(value, bool):
        if column == "healthy":
            return "up" if value else "down"
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    return "-" if value is None else str(value)


def admin_context(
    session: Session, start: datetime, end: datetime, workers: WorkerRows
) -> dict[str, Any]:
    """Everything the operator dashboard shows for ``[start, end)`` (whole UTC days)."""
    names = {tid: name for tid, name in session.execute(select(Tenant.id, Tenant.name))}
    daily = UsageQuery(start, end, None, width=BucketWidth.DAY, group_by=(GroupBy.TENANT,))
    usage = roll_up(aggregate_usage(session, daily), lambda r: r.tenant_id)
    per_tenant = [UsageRow(None, tid, None, None, t) for tid, t in usage.items()]
    tenants = [
        {"name": name, "id": tid, **totals_view(usage.get(tid, UsageTotals()))}
        for tid, name in sorted(names.items(), key=lambda item: item[1])
    ]
    spenders = sorted(per_tenant, key=lambda r: r.totals.billed_pico, reverse=True)[:TOP_SPENDERS]
    columns = list(dict.fromkeys(column for row in workers for column in row))
    return {
        "totals": totals_view(sum_rows(per_tenant)),
        "tenants": tenants,
        "top_spenders": [
            {"name": names.get(r.tenant_id or 0, "?"), **totals_view(r.totals)} for r in spenders
        ],
        "chart": {
            "labels": [names.get(r.tenant_id or 0, "?") for r in spenders],
            "billed": [exact_usd(r.totals.billed_pico) for r in spenders],
            "list": [exact_usd(r.totals.list_pico) for r in spenders],
        },
        "worker_columns": [worker_label(c) for c in columns],
        "workers": [[worker_cell(c, row.get(c, "")) for c in columns] for row in workers],
        "invoices": invoice_rows(list_invoices(session, None)[:50], "/admin/v1/invoices", names),
        "budgets": budget_rows(budget_statuses(session, None), {}),
    }
