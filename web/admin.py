"""Operator dashboard and cross-tenant APIs under ``/admin``.

    GET  /admin/dashboard                          sign-in form or the dashboard
    POST /admin/dashboard/login | logout           admin token form -> admin cookie
    GET  /admin/v1/organization/usage/completions  as the tenant API, all tenants;
    GET  /admin/v1/organization/costs              ``tenant=NAME`` filters, ``group_by``
                                                   also accepts ``tenant``
    GET  /admin/v1/invoices[?tenant=NAME]
    GET  /admin/v1/invoices/preview?tenant=NAME    the tenant's open month (draft)
    GET  /admin/v1/invoices/{id}
    GET  /admin/v1/invoices/{id}/download?format=

Everything answers 503 while ``Settings.admin_token_problem()`` reports a problem.
Worker status rows come from a callable the proxy passes in (``[]`` if none).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime

from fastapi import APIRouter, Form, Query, Request
from fastapi.responses import RedirectResponse, Response
from jinja2 import Environment
from sqlalchemy.orm import Session, sessionmaker

from billing.accounts import get_tenant_by_name
from billing.usage import GroupBy
from kvtoll.settings import Settings
from web.api_views import cost_result, usage_result
from web.auth import ADMIN_COOKIE, AdminAuth, check_same_origin, clear_cookie, set_cookie
from web.dashboard_data import WorkerRows, admin_context
from web.errors import ApiError, bad_param
from web.pages import add_static_route, render_page, template_environment
from web.params import picked_range, range_fields
from web.semantic_view import SemanticStatusFn, bound_view
from web.usage_api import (
    ResultFn,
    bucketed_answer,
    detail_answer,
    download_answer,
    guarded,
    invoice_list_answer,
    preview_answer,
)

STATIC_PREFIX = "/admin/static"
ADMIN_GROUPS = (GroupBy.TENANT, GroupBy.MODEL, GroupBy.API_KEY)
WorkerStatusFn = Callable[[], WorkerRows]


def _tenant_filter(factory: sessionmaker[Session], name: str | None) -> int | None:
    if name is None or name == "":
        return None
    with factory() as session:
        tenant = get_tenant_by_name(session, name)
    if tenant is None:
        raise bad_param("tenant", f"unknown tenant {name!r}")
    return tenant.id


def _add_api_routes(router: APIRouter, factory: sessionmaker[Session], auth: AdminAuth) -> None:
    def answer(request: Request, result: ResultFn) -> Response:
        auth.require(request)
        tenant_id = _tenant_filter(factory, request.query_params.get("tenant"))
        return bucketed_answer(
            factory, request, tenant_id=tenant_id, allowed=ADMIN_GROUPS, result=result
        )

    @router.get("/admin/v1/organization/usage/completions")
    def usage_completions(request: Request) -> Response:
        return guarded(lambda: answer(request, usage_result))

    @router.get("/admin/v1/organization/costs")
    def costs(request: Request) -> Response:
        return guarded(lambda: answer(request, cost_result))

    @router.get("/admin/v1/invoices")
    def invoices(request: Request, tenant: str | None = Query(None)) -> Response:
        def body() -> Response:
            auth.require(request)
            tenant_id = _tenant_filter(factory, tenant)
            return invoice_list_answer(factory, tenant_id, "/admin/v1/invoices", True)

        return guarded(body)

    @router.get("/admin/v1/invoices/preview")  # before {invoice_id}
    def invoice_preview(request: Request, tenant: str | None = Query(None)) -> Response:
        def body() -> Response:
            auth.require(request)
            tenant_id = _tenant_filter(factory, tenant)
            if tenant_id is None:
                raise bad_param("tenant", "tenant is required: ?tenant=NAME")
            return preview_answer(factory, tenant_id)

        return guarded(body)

    @router.get("/admin/v1/invoices/{invoice_id}")
    def invoice(request: Request, invoice_id: str) -> Response:
        def body() -> Response:
            auth.require(request)
            return detail_answer(factory, invoice_id, None)

        return guarded(body)

    @router.get("/admin/v1/invoices/{invoice_id}/download")
    def download(request: Request, invoice_id: str, format: str | None = Query(None)) -> Response:
        def body() -> Response:
            auth.require(request)
            return download_answer(factory, invoice_id, format, None)

        return guarded(body)


class AdminPages:
    """Handlers of the operator pages (thin: data comes from :mod:`web.dashboard_data`)."""

    def __init__(self, factory: sessionmaker[Session], auth: AdminAuth, env: Environment,
                 worker_status: WorkerStatusFn | None,
                 semantic_status: SemanticStatusFn | None = None) -> None:  # fmt: skip
        self._factory, self._auth, self._env = factory, auth, env
        self._worker_status = worker_status
        self._semantic_status = semantic_status

    def login_page(self, status: int = 200, error: str | None = None) -> Response:
        auth = self._auth
        return render_page(self._env, "login.html", status, static=STATIC_PREFIX,
                           error=error or auth.problem, disabled=auth.problem is not None,
                           action="/admin/dashboard/login", field="admin_token",
                           title="Operator dashboard", label="Admin token", placeholder="")

    def workers(self) -> WorkerRows:
        """The proxy's worker rows; a failing callable shows as one row, not a 500."""
        if self._worker_status is None:
            return []
        try:
            return list(self._worker_status())
        except Exception as exc:  # the page must stay up when a worker probe breaks
            return [{"error": f"worker status unavailable: {type(exc).__name__}"}]

    def dashboard(self, request: Request, start: str | None = None,
                  end: str | None = None) -> Response:
        if not self._auth.is_signed_in(request):
            return self.login_page(503 if self._auth.problem else 200)
        first, stop, error = picked_range(start, end, datetime.now(UTC))
        with self._factory() as session:
            context = admin_context(session, first, stop, self.workers())
        return render_page(
            self._env, "admin.html", 400 if error else 200, static=STATIC_PREFIX, error=error,
            dev_mode=self._auth.dev_mode, **range_fields(first, stop), **context,
            semantic_bound=bound_view(self._semantic_status),
        )

    def login(self, request: Request, admin_token: str = Form("")) -> Response:
        try:
            self._auth.check_enabled()
            check_same_origin(request)
        except ApiError as exc:
            return exc.response()
        if not self._auth.token_matches(admin_token):
            return self.login_page(401, "That admin token is not valid.")
        response = RedirectResponse("/admin/dashboard", status_code=303)
        set_cookie(response, request, ADMIN_COOKIE, self._auth.new_session(), "/admin")
        return response

    def logout(self, request: Request) -> Response:
        """End the operator session server-side (a copied cookie stops working too)."""
        self._auth.sign_out(request)
        response = RedirectResponse("/admin/dashboard", status_code=303)
        clear_cookie(response, request, ADMIN_COOKIE, "/admin")
        return response


def build_admin_dashboard_router(
    session_factory: sessionmaker[Session],
    settings: Settings,
    *,
    worker_status: WorkerStatusFn | None = None,
    semantic_status: SemanticStatusFn | None = None,
) -> APIRouter:
    """Admin pages and APIs; ``worker_status()`` returns one mapping per worker,
    ``semantic_status()`` one per tenant (:mod:`web.semantic_view`)."""
    auth = AdminAuth(settings, session_factory)
    pages = AdminPages(session_factory, auth, template_environment(), worker_status,
                       semantic_status)
    router = APIRouter(include_in_schema=False)
    add_static_route(router, STATIC_PREFIX)
    _add_api_routes(router, session_factory, auth)
    router.add_api_route("/admin/dashboard", pages.dashboard, methods=["GET"])
    router.add_api_route("/admin/dashboard/login", pages.login, methods=["POST"])
    router.add_api_route("/admin/dashboard/logout", pages.logout, methods=["POST"])
    return router
