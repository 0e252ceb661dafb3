"""JSON bodies of the usage, costs and invoice APIs (no web framework here).

Shapes follow OpenAI's organization usage / costs APIs: a ``page`` of ``bucket``
objects, each with ``results``. Money amounts are ``{"value", "currency"}`` where
``value`` is a JSON number written with every picodollar (never through a float).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from datetime import datetime
from decimal import Decimal
from typing import Any

from fastapi.responses import Response

from billing.models import Invoice
from billing.money import pico_to_usd
from billing.usage import GroupBy, UsageRow
from web.params import BucketPage, encode_page


class ExactJSONResponse(Response):
    """JSON where ``Decimal`` values become number literals with all their digits."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        marker = uuid.uuid4().hex
        found: dict[str, str] = {}

        def encode(value: Any) -> Any:
            if isinstance(value, Decimal):
                key = f"{marker}{len(found)}"
                found[key] = format(value, "f")
                return key
            raise TypeError(f"cannot serialise {type(value).__name__}")

        text = json.dumps(content, default=encode, separators=(",", ":"))
        for key, literal in found.items():
            text = text.replace(f'"{key}"', literal, 1)
        return text.encode()


def money(pico: int) -> dict[str, Any]:
    return {"value": pico_to_usd(pico), "currency": "usd"}


def _unix(moment: datetime) -> int:
    return int(moment.timestamp())


def _group_fields(row: UsageRow, group_by: Sequence[GroupBy], names: Mapping[int, str]) -> dict:
    fields: dict[str, Any] = {
        "project_id": None,
        "api_key_id": row.api_key_id if GroupBy.API_KEY in group_by else None,
        "model": row.model if GroupBy.MODEL in group_by else None,
    }
    if GroupBy.TENANT in group_by and row.tenant_id is not None:
        fields["tenant_id"] = row.tenant_id
        fields["tenant"] = names.get(row.tenant_id)
    return fields


def usage_result(row: UsageRow, group_by: Sequence[GroupBy], names: Mapping[int, str]) -> dict:
    t = row.totals
    return {
        "object": "organization.usage.completions.result",
        "input_tokens": t.prompt_tokens,
        "output_tokens": t.completion_tokens,
        "input_cached_tokens": t.cached_tokens,
        "input_audio_tokens": 0,
        "output_audio_tokens": 0,
        "num_model_requests": t.num_requests,
        "semantic_hit_requests": t.semantic_requests,
        "semantic_hit_tokens": t.semantic_tokens,
        # kvtoll: of input_cached_tokens, those loaded from a worker's KV tier
        "input_cached_tokens_details": {
            "kvtoll_tier_host": t.tier_host_cached_tokens,
            "kvtoll_tier_shared": t.tier_shared_cached_tokens,
        },
        "user_id": None,
        "batch": None,
        **_group_fields(row, group_by, names),
    }


def cost_result(row: UsageRow, group_by: Sequence[GroupBy], names: Mapping[int, str]) -> dict:
    t = row.totals
    return {
        "object": "organization.costs.result",
        "amount": money(t.billed_pico),
        "list_amount": money(t.list_pico),
        "savings": money(t.savings_pico),
        "line_item": None,
        **_group_fields(row, group_by, names),
    }


def bucket_page(
    page: BucketPage, rows: Sequence[UsageRow], result: Any, names: Mapping[int, str]
) -> dict[str, Any]:
    """Place ``rows`` (bucketed by UTC boundary) into ``page``'s buckets."""
    by_start: dict[int, list[dict]] = {}
    for row in rows:
        if row.bucket_start is None:
            raise RuntimeError("bucketed query returned a row without a bucket")
        key = _unix(row.bucket_start)
        by_start.setdefault(key, []).append(result(row, page.group_by, names))
    step = int(page.width.delta.total_seconds())
    data = [
        {
            "object": "bucket",
            "start_time": _unix(start),
            "end_time": _unix(end),
            "results": by_start.get(_unix(start) // step * step, []),
        }
        for start, end in page.buckets
    ]
    return {
        "object": "page",
        "data": data,
        "has_more": page.next_start is not None,
        "next_page": encode_page(page.next_start) if page.next_start is not None else None,
    }


def invoice_summary(invoice: Invoice, base_path: str, tenant_name: str | None) -> dict:
    """One invoice in the ``/v1/invoices`` list (no lines)."""
    summary: dict[str, Any] = {
        "object": "invoice",
        "id": invoice.id,
        "period": invoice.period,
        "status": invoice.status.value,
        "closed_at": _unix(invoice.closed_at),
        "amount": money(invoice.total_pico),
        "list_amount": money(invoice.list_pico),
        "savings": money(invoice.list_pico - invoice.total_pico),
        "downloads": {
            fmt: f"{base_path}/{invoice.id}/download?format={fmt}" for fmt in ("csv", "json", "pdf")
        },
    }
    if tenant_name is not None:
        summary["tenant"] = tenant_name
        summary["tenant_id"] = invoice.tenant_id
    return summary
