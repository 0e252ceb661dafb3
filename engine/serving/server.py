"""Running an ASGI app under uvicorn: in the foreground (``kvtoll worker``) or on the
current event loop in the background (tests, benchmarks, an embedded worker).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import uvicorn
from fastapi import FastAPI


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
