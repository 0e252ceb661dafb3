"""Operational routes: liveness and readiness (no auth), Prometheus metrics (bearer:
``KVTOLL_METRICS_TOKEN`` or the admin token; open only in dev mode without a metrics
token, since they name tenants and their rates)."""

from __future__ import annotations

import hmac
import logging
from typing import Annotated

import anyio
from fastapi import APIRouter, Header, Response
from fastapi.responses import JSONResponse

from kvtoll.openai.errors import INVALID_REQUEST, OpenAIError
from kvtoll.settings import Settings
from kvtoll.worker_auth import presented_token
from proxy.deps import StateDep

log = logging.getLogger(__name__)

router = APIRouter()


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """Liveness: the process answers."""
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(state: StateDep) -> Response:
    """Readiness: at least one upstream healthy and every dependency answering its
    background probe (:mod:`proxy.probes`: ``database``, ``redis``); else 503, with
    ``down`` naming what is down or hanging. Never waits on a dependency itself. While
    not ready the gateway still serves what it can (keys it knows, usage into the
    outbox)."""
    upstreams = state.pool.any_healthy()
    results = state.probes.results()
    down = [name for name, r in results.items() if not r.ok]
    if not upstreams:
        down.append("upstreams")
    backlog = await anyio.to_thread.run_sync(state.outbox.depth)
    ready = not down
    body = {
        "status": "ready" if ready else "unready",
        "down": down,
        "dependencies": {name: {"ok": r.ok, "detail": r.detail} for name, r in results.items()},
        "upstreams_healthy": upstreams,
        "upstreams": {u.name: state.pool.is_healthy(u.name) for u in state.pool.upstreams},
        "ledger": "outbox" if backlog or state.meter.db_suspected_down else "ok",
        "outbox_depth": backlog,
        # upstreams whose usage lacks prompt_tokens_details (proxy.upstream.usage_report)
        "billing_warnings": state.pool.usage_problems(),
    }
    return JSONResponse(body, status_code=200 if ready else 503)


def metrics_allowed(settings: Settings, authorization: str | None) -> bool:
    """Open in dev mode without a metrics token; else the metrics or the admin token."""
    if settings.metrics_open():
        return True
    token = presented_token(authorization)
    if token is None:
        return False
    given = token.encode()
    allowed = False
    for secret in (settings.metrics_token, settings.admin_token):
        expected = secret.get_secret_value().encode()
        allowed |= bool(expected) and hmac.compare_digest(given, expected)
    return allowed


@router.get("/metrics")
async def metrics(
    state: StateDep, authorization: Annotated[str | None, Header()] = None
) -> Response:
    """Prometheus text exposition of this app's registry (see module doc)."""
    if not metrics_allowed(state.settings, authorization):
        log.warning("refused /metrics: %s token", "missing" if authorization is None else "wrong")
        raise OpenAIError("send Authorization: Bearer <metrics or admin token>", status=401,
                          type=INVALID_REQUEST, code="invalid_metrics_token")
    payload, content_type = state.metrics.exposition()
    return Response(payload, media_type=content_type)
