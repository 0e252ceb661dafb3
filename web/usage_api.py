"""Tenant JSON APIs: usage, costs and invoices, shaped like OpenAI's organization APIs.

    GET /v1/organization/usage/completions   buckets of token and request counts
    GET /v1/organization/costs               buckets of billed and list amounts
    GET /v1/invoices                         closed invoices
    GET /v1/invoices/preview                 the open month as it stands (draft, no id)
    GET /v1/invoices/{id}                    one invoice with its lines (JSON)
    GET /v1/invoices/{id}/download?format=   csv | json | pdf

Every query is scoped to the caller's tenant (from the key or the session
cookie); another tenant's invoice is answered with 404, like an unknown one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from billing.errors import NotFound
from billing.invoice_export import (
    ExportFormat,
    InvoiceDocument,
    load_document,
    render,
    to_json,
)
from billing.invoice_preview import preview_invoice, preview_payload
from billing.invoices import list_invoices
from billing.models import Tenant
from billing.usage import GroupBy, UsageQuery, aggregate_usage
from kvtoll.settings import Settings
from web.api_views import ExactJSONResponse, bucket_page, cost_result, invoice_summary, usage_result
from web.auth import KeyResolver, TenantAuth, session_secret
from web.errors import ApiError, bad_param, not_found
from web.params import is_number, parse_bucket_page, parse_group_by

TENANT_GROUPS = (GroupBy.MODEL, GroupBy.API_KEY)
MAX_INVOICE_ID = 2**31 - 1  # the column is a 32-bit integer
ResultFn = Callable[..., dict]


def guarded(call: Callable[[], Response]) -> Response:
    """Run a handler body; an :class:`ApiError` becomes its OpenAI-shaped response."""
    try:
        return call()
    except ApiError as exc:
        return exc.response()


def tenant_names(session: Session) -> dict[int, str]:
    return {row[0]: row[1] for row in session.execute(select(Tenant.id, Tenant.name))}


def bucketed_answer(
    factory: sessionmaker[Session],
    request: Request,
    *,
    tenant_id: int | None,
    allowed: Sequence[GroupBy],
    result: ResultFn,
) -> Response:
    """Parse the bucket parameters, aggregate in SQL, answer one page."""
    params = request.query_params
    group_by = parse_group_by(params.getlist("group_by") + params.getlist("group_by[]"), allowed)
    page = parse_bucket_page(
        start_time=params.get("start_time"), end_time=params.get("end_time"),
        bucket_width=params.get("bucket_width"), limit=params.get("limit"),
        page=params.get("page"), group_by=group_by, now=datetime.now(UTC),
    )
    query = UsageQuery(
        start=page.start, end=page.end, tenant_id=tenant_id, width=page.width, group_by=group_by
    )
    with factory() as session:
        rows = aggregate_usage(session, query) if page.buckets else []
        names: Mapping[int, str] = tenant_names(session) if GroupBy.TENANT in group_by else {}
    return ExactJSONResponse(bucket_page(page, rows, result, names))


def invoice_list_answer(
    factory: sessionmaker[Session], tenant_id: int | None, base_path: str, with_tenant: bool
) -> Response:
    with factory() as session:
        invoices = list_invoices(session, tenant_id)
        names = tenant_names(session) if with_tenant else {}
    data = [
        invoice_summary(inv, base_path, names.get(inv.tenant_id) if with_tenant else None)
        for inv in invoices
    ]
    return ExactJSONResponse({"object": "list", "data": data, "has_more": False})


def preview_answer(factory: sessionmaker[Session], tenant_id: int) -> Response:
    """The draft invoice of the tenant's open month (read-only, never cached)."""
    with factory() as session:
        tenant = session.get(Tenant, tenant_id)
        if tenant is None:
            raise not_found(f"unknown tenant {tenant_id}")
        payload = preview_payload(preview_invoice(session, tenant))
    return ExactJSONResponse(payload, headers={"Cache-Control": "no-store"})


def _document(
    factory: sessionmaker[Session], invoice_id: str, tenant_id: int | None
) -> InvoiceDocument:
    if not is_number(invoice_id) or int(invoice_id) > MAX_INVOICE_ID:
        raise not_found(f"unknown invoice {invoice_id!r}")
    try:
        with factory() as session:
            return load_document(session, int(invoice_id), tenant_id)
    except NotFound as exc:
        raise not_found(str(exc)) from None


def detail_answer(
    factory: sessionmaker[Session], invoice_id: str, tenant_id: int | None
) -> Response:
    """One invoice with its lines, as JSON (the same document as the JSON export)."""
    doc = _document(factory, invoice_id, tenant_id)
    return Response(to_json(doc), media_type="application/json",
                    headers={"Cache-Control": "no-store"})


def download_answer(
    factory: sessionmaker[Session], invoice_id: str, fmt: str | None, tenant_id: int | None
) -> Response:
    """One invoice export as an attachment; 404 if not visible to ``tenant_id``."""
    try:
        kind = ExportFormat((fmt or "pdf").lower())
    except ValueError:
        raise bad_param("format", "format must be csv, json or pdf") from None
    doc = _document(factory, invoice_id, tenant_id)
    name = f"{doc.filename_stem}.{kind.value}"
    return Response(
        render(doc, kind), media_type=kind.media_type,
        headers={"Content-Disposition": f'attachment; filename="{name}"',
                 "Cache-Control": "no-store"},
    )


def build_usage_api_router(
    session_factory: sessionmaker[Session],
    settings: Settings,
    *,
    resolver: KeyResolver | None = None,
    tenant_auth: TenantAuth | None = None,
) -> APIRouter:
    """Tenant APIs; pass ``tenant_auth`` (sessions) to share it with the dashboard router."""
    auth = tenant_auth or TenantAuth(session_factory, session_secret(settings), resolver)
    router = APIRouter(tags=["usage"])

    def answer(request: Request, result: ResultFn) -> Response:
        tenant_id = auth.require(request).tenant_id
        return bucketed_answer(
            session_factory, request, tenant_id=tenant_id, allowed=TENANT_GROUPS, result=result
        )

    @router.get("/v1/organization/usage/completions")
    def usage_completions(request: Request) -> Response:
        return guarded(lambda: answer(request, usage_result))

    @router.get("/v1/organization/costs")
    def costs(request: Request) -> Response:
        return guarded(lambda: answer(request, cost_result))

    @router.get("/v1/invoices")
    def invoices(request: Request) -> Response:
        def body() -> Response:
            tenant_id = auth.require(request).tenant_id
            return invoice_list_answer(session_factory, tenant_id, "/v1/invoices", False)

        return guarded(body)

    @router.get("/v1/invoices/preview")  # before {invoice_id}, which would take the path
    def invoice_preview(request: Request) -> Response:
        return guarded(lambda: preview_answer(session_factory, auth.require(request).tenant_id))

    @router.get("/v1/invoices/{invoice_id}")
    def invoice(request: Request, invoice_id: str) -> Response:
        def body() -> Response:
            tenant_id = auth.require(request).tenant_id
            return detail_answer(session_factory, invoice_id, tenant_id)

        return guarded(body)

    @router.get("/v1/invoices/{invoice_id}/download")
    def download(request: Request, invoice_id: str, format: str | None = Query(None)) -> Response:
        def body() -> Response:
            tenant_id = auth.require(request).tenant_id
            return download_answer(session_factory, invoice_id, format, tenant_id)

        return guarded(body)

    return router
