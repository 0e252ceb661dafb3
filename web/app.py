"""A standalone app with only the web routes (dashboards and usage APIs).

The proxy includes the same routers in its own app; this factory serves tests
and a dashboard-only deployment.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import RedirectResponse
from sqlalchemy.orm import Session, sessionmaker

from kvtoll.settings import Settings
from web.admin import WorkerStatusFn, build_admin_dashboard_router
from web.auth import KeyResolver, TenantAuth, session_secret
from web.dashboard import build_dashboard_router
from web.semantic_view import SemanticStatusFn
from web.usage_api import build_usage_api_router


def include_web_routers(
    app: FastAPI,
    session_factory: sessionmaker[Session],
    settings: Settings,
    *,
    resolver: KeyResolver | None = None,
    worker_status: WorkerStatusFn | None = None,
    semantic_status: SemanticStatusFn | None = None,
) -> None:
    """Add the dashboard, usage API and admin routers to ``app`` (one shared tenant auth)."""
    auth = TenantAuth(session_factory, session_secret(settings), resolver)
    for router in (
        build_dashboard_router(session_factory, settings, tenant_auth=auth,
                               semantic_status=semantic_status),
        build_usage_api_router(session_factory, settings, tenant_auth=auth),
        build_admin_dashboard_router(session_factory, settings, worker_status=worker_status,
                                     semantic_status=semantic_status),
    ):
        app.include_router(router)


def create_web_app(
    settings: Settings,
    session_factory: sessionmaker[Session],
    *,
    worker_status: WorkerStatusFn | None = None,
    semantic_status: SemanticStatusFn | None = None,
) -> FastAPI:
    """The web routes alone, with ``/`` redirecting to the tenant dashboard."""
    app = FastAPI(title="kvtoll dashboard", docs_url=None, redoc_url=None)
    include_web_routers(app, session_factory, settings, worker_status=worker_status,
                        semantic_status=semantic_status)

    @app.get("/", include_in_schema=False)
    def root() -> RedirectResponse:
        return RedirectResponse("/dashboard")

    return app
