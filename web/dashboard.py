"""Tenant dashboard pages at ``/dashboard``.

    GET  /dashboard              sign-in form, or the dashboard (?start=&end= ISO dates)
    POST /dashboard/login        form field ``api_key``; sets the session cookie
    POST /dashboard/logout       ends the session server-side and clears the cookie
    GET  /dashboard/static/...   CSS, JS and the vendored Chart.js

Invoice downloads on the page link to ``/v1/invoices/{id}/download`` (cookie auth).
"""

from __future__ import annotations

from datetime import UTC, datetime

from fastapi import APIRouter, Form, Request
from fastapi.responses import RedirectResponse, Response
from jinja2 import Environment
from sqlalchemy.orm import Session, sessionmaker

from kvtoll.settings import Settings
from web.auth import (
    TENANT_COOKIE,
    KeyResolver,
    TenantAuth,
    check_same_origin,
    clear_cookie,
    session_secret,
)
from web.auth import set_cookie as set_session_cookie
from web.dashboard_data import tenant_context
from web.errors import ApiError
from web.pages import add_static_route, render_page, template_environment
from web.params import picked_range, range_fields
from web.semantic_view import SemanticStatusFn, bound_view

STATIC_PREFIX = "/dashboard/static"


class TenantPages:
    """Handlers of the tenant pages (thin: data comes from :mod:`web.dashboard_data`)."""

    def __init__(self, factory: sessionmaker[Session], auth: TenantAuth, env: Environment,
                 semantic_status: SemanticStatusFn | None = None) -> None:  # fmt: skip
        self._factory, self._auth, self._env = factory, auth, env
        self._semantic_status = semantic_status

    def login_page(self, status: int = 200, error: str | None = None) -> Response:
        return render_page(self._env, "login.html", status, static=STATIC_PREFIX, error=error,
                           action="/dashboard/login", field="api_key", title="Usage dashboard",
                           label="API key", placeholder="kvt_…")

    def dashboard(self, request: Request, start: str | None = None,
                  end: str | None = None) -> Response:
        principal = self._auth.from_cookie(request)
        if principal is None:
            return self.login_page()
        first, stop, error = picked_range(start, end, datetime.now(UTC))
        with self._factory() as session:
            context = tenant_context(session, principal.tenant_id, first, stop)
        return render_page(
            self._env, "dashboard.html", 400 if error else 200, static=STATIC_PREFIX,
            error=error, tenant=principal.tenant_name, **range_fields(first, stop), **context,
            semantic_bound=bound_view(self._semantic_status, principal.tenant_id),
        )

    def login(self, request: Request, api_key: str = Form("")) -> Response:
        try:
            check_same_origin(request)
        except ApiError as exc:
            return exc.response()
        signed_in = self._auth.sign_in(api_key) if api_key else None
        if signed_in is None:
            return self.login_page(401, "That API key is not valid (or was revoked).")
        response = RedirectResponse("/dashboard", status_code=303)
        set_session_cookie(response, request, TENANT_COOKIE, signed_in[1], "/")
        return response

    def logout(self, request: Request) -> Response:
        """End the session server-side (a copied cookie stops working too)."""
        self._auth.sign_out(request)
        response = RedirectResponse("/dashboard", status_code=303)
        clear_cookie(response, request, TENANT_COOKIE, "/")
        return response


def build_dashboard_router(
    session_factory: sessionmaker[Session],
    settings: Settings,
    *,
    resolver: KeyResolver | None = None,
    tenant_auth: TenantAuth | None = None,
    semantic_status: SemanticStatusFn | None = None,
) -> APIRouter:
    """The tenant dashboard; share ``tenant_auth`` with
    :func:`build_usage_api_router` (see :func:`web.app.include_web_routers`)."""
    auth = tenant_auth or TenantAuth(session_factory, session_secret(settings), resolver)
    pages = TenantPages(session_factory, auth, template_environment(), semantic_status)
    router = APIRouter(include_in_schema=False)
    add_static_route(router, STATIC_PREFIX)
    router.add_api_route("/dashboard", pages.dashboard, methods=["GET"])
    router.add_api_route("/dashboard/login", pages.login, methods=["POST"])
    router.add_api_route("/dashboard/logout", pages.logout, methods=["POST"])
    return router
