"""Running an ASGI app under uvicorn: the worker in the foreground (``kvtoll worker``,
:func:`serve_worker`) or any app on the current event loop in the background (tests,
benchmarks, an embedded worker: :func:`serve_in_background`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import uvicorn
from fastapi import FastAPI

from engine.api import AsyncEngineClient
from engine.serving.app import WorkerConfig, build_worker_app
from engine.serving.registration import Registration, run_registration


def uvicorn_config(app: FastAPI, host: str, port: int, log_level: str = "info") -> uvicorn.Config:
    """The uvicorn settings every kvtoll server uses (no access log, h11, asyncio)."""
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=False,
        loop="asyncio",
        http="h11",
        lifespan="off",
        timeout_graceful_shutdown=5,
    )


@contextlib.asynccontextmanager
async def serve_in_background(
    app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"
) -> AsyncIterator[str]:
    """Serve ``app`` on this event loop; yields its base URL (``port=0``: a free port)."""
    server = uvicorn.Server(uvicorn_config(app, host, port, log_level))
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:
            if task.done():
                task.result()
                raise RuntimeError("uvicorn stopped before it started")
            await asyncio.sleep(0.01)
        bound = server.servers[0].sockets[0].getsockname()
        yield f"http://{bound[0]}:{bound[1]}"
    finally:
        server.should_exit = True
        await task


async def serve_worker(
    engine: AsyncEngineClient,
    worker: WorkerConfig,
    host: str,
    port: int,
    log_level: str = "info",
    registration: Registration | None = None,
) -> None:
    """Serve the worker app until a signal stops uvicorn; meanwhile announce the
    worker and publish its KV events when ``registration`` is given."""
    app = build_worker_app(engine, worker)
    server = uvicorn.Server(uvicorn_config(app, host, port, log_level))
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
