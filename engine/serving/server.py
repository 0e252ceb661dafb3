"""``kvtoll worker`` in the foreground: the worker app under uvicorn, announced and
publishing KV events while it runs (servers are built by :mod:`kvtoll.server`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import uvicorn

from engine.api import AsyncEngineClient
from engine.serving.app import WorkerConfig, build_worker_app
from engine.serving.registration import Registration, run_registration
from kvtoll.server import uvicorn_config


def tier_metrics(engine: AsyncEngineClient) -> Callable[[], str] | None:
    """The tier-2 ``/metrics`` text of an in-process engine with a tier, else None."""
    from engine.async_engine import AsyncEngine

    tier = engine.engine.tier if isinstance(engine, AsyncEngine) else None
    if tier is None:
        return None
    from engine.serving.tier_metrics import tier_metrics_text

    return lambda: tier_metrics_text(tier)


async def serve_worker(
    engine: AsyncEngineClient,
    worker: WorkerConfig,
    host: str,
    port: int,
    log_level: str = "info",
    registration: Registration | None = None,
    tls: tuple[str, str] | None = None,
) -> None:
    """Serve the worker app (https with ``tls``: certificate, key) until a signal stops
    uvicorn; meanwhile announce the worker and publish its KV events when
    ``registration`` is given."""
    app = build_worker_app(engine, worker, tier_metrics(engine))
    server = uvicorn.Server(uvicorn_config(app, host, port, log_level, tls=tls))
    stop = asyncio.Event()
    side: asyncio.Task[None] | None = None
    if registration is not None:
        instance_id = app.state.worker.instance_id
        side = asyncio.create_task(run_registration(registration, engine, instance_id, stop))
    try:
        await server.serve()
    finally:
        stop.set()
        if side is not None:
            await side
