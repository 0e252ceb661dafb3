"""Operational routes: liveness, readiness, Prometheus metrics (no auth)."""

from __future__ import annotations

import anyio
from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse

from proxy.deps import StateDep

router = APIRouter()


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """Liveness: the process answers."""
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(state: StateDep) -> Response:
    """Readiness: at least one upstream healthy. A failing database does not make the
    gateway unready (usage goes to the outbox); it is reported in the body."""
    ready = state.pool.any_healthy()
    backlog = await anyio.to_thread.run_sync(state.outbox.depth)
    body = {
        "status": "ready" if ready else "unready",
        "upstreams_healthy": ready,
        "ledger": "outbox" if backlog or state.meter.db_suspected_down else "ok",
        "outbox_depth": backlog,
    }
    return JSONResponse(body, status_code=200 if ready else 503)


@router.get("/metrics")
async def metrics(state: StateDep) -> Response:
    """Prometheus text exposition of this app's registry."""
    payload, content_type = state.metrics.exposition()
    return Response(payload, media_type=content_type)
