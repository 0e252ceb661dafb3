"""The gateway's front door: ``GET /`` (links to every page a newcomer looks for) and
``GET /docs`` (the HTTP API, listed from the app's own OpenAI schema, served with the
pages' strict CSP: no script or stylesheet from elsewhere).

    GET /       landing page: tenant dashboard, operator dashboard, API reference, metrics
    GET /docs   every route of the app: method, path, summary (/openapi.json in full)
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from web.dashboard import STATIC_PREFIX
from web.pages import render_page, template_environment

LINKS = (
    ("/dashboard", "Usage dashboard", "tenants: sign in with an API key (kvt_…)"),
    ("/admin/dashboard", "Operator dashboard", "every tenant, workers, budgets: admin token"),
    ("/docs", "HTTP API", "the OpenAI-compatible API and kvtoll's own routes"),
    ("/metrics", "Metrics", "Prometheus text (metrics or admin token; open in dev mode)"),
)
_METHODS = ("get", "post", "put", "patch", "delete")


def api_routes(schema: dict[str, Any]) -> list[dict[str, str]]:
    """One row per method and path of an OpenAPI ``schema``, in path order."""
    rows = []
    for path, item in sorted(schema.get("paths", {}).items()):
        for method in _METHODS:
            operation = item.get(method)
            if operation is not None:
                summary = operation.get("summary") or operation.get("description") or ""
                rows.append({"method": method.upper(), "path": path,
                             "summary": summary.strip().splitlines()[0] if summary else ""})
    return rows


def build_landing_router(*, dev_mode: bool) -> APIRouter:
    """``/`` and ``/docs`` (see module doc)."""
    router = APIRouter()
    env = template_environment()

    @router.get("/", include_in_schema=False)
    def landing() -> Response:
        return render_page(env, "landing.html", static=STATIC_PREFIX, links=LINKS,
                           dev_mode=dev_mode)

    @router.get("/docs", include_in_schema=False)
    def docs(request: Request) -> Response:
        routes = api_routes(request.app.openapi())
        return render_page(env, "docs.html", static=STATIC_PREFIX, routes=routes)

    return router
