"""Building servers: every kvtoll HTTP server (gateway, worker, tests' and benchmarks'
background servers) runs under uvicorn with the settings of :func:`uvicorn_config`.

The gateway's servers (``fast=True``) use httptools and uvloop, and coalesce writes
(:mod:`kvtoll.coalescing`); an app with direct routes (the gateway's completion paths)
has them served without uvicorn's ASGI request cycle (:mod:`kvtoll.direct_http`).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import socket
from collections.abc import AsyncIterator
from typing import Any, Literal

import uvicorn

from kvtoll.coalescing import CoalescingHttpToolsProtocol
from kvtoll.direct_http import DirectRouteProtocol, DirectRoutes


def check_port_free(host: str, port: int) -> None:
    """``ValueError`` if ``host:port`` cannot be bound (in use, bad address)."""
    if not 0 <= port <= 65535:
        raise ValueError(f"--port must be between 0 and 65535, got {port}")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ValueError(f"cannot resolve --host {host!r}: {exc.strerror}") from None
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            why = "already in use" if exc.errno == errno.EADDRINUSE else exc.strerror
            raise ValueError(f"cannot listen on {host}:{port}: {why}") from None


def check_tls_files(cert: str | None, key: str | None) -> tuple[str, str] | None:
    """``(cert, key)`` to serve https with, ``None`` for plain http; ``ValueError`` if
    only one is given or a file cannot be read."""
    if cert is None and key is None:
        return None
    if cert is None or key is None:
        raise ValueError("--tls-cert and --tls-key go together (give both or neither)")
    for flag, path in (("--tls-cert", cert), ("--tls-key", key)):
        try:
            with open(path, "rb"):
                pass
        except OSError as exc:
            raise ValueError(f"cannot read {flag} {path}: {exc.strerror}") from None
    return cert, key


def uvicorn_config(app: Any, host: str, port: int, log_level: str = "info", *,
                   fast: bool = False, lifespan: Literal["on", "off"] = "off",
                   tls: tuple[str, str] | None = None, **options: Any) -> uvicorn.Config:
    """The uvicorn settings every kvtoll server uses: no access log unless
    ``access_log=True`` (``KVTOLL_ACCESS_LOG``: one log line per request costs more than
    the request; worker polls log at DEBUG, :mod:`kvtoll.logs`), a 5 s graceful
    shutdown, h11 on asyncio, or
    with ``fast`` httptools with coalesced writes on uvloop where available (the
    gateway; an app with direct routes gets them, :mod:`kvtoll.direct_http`).
    ``lifespan="on"`` for an app that starts its background loops there;
    ``tls``: serve https with that (certificate, private key) pair."""
    if tls is not None:
        options.update(ssl_certfile=tls[0], ssl_keyfile=tls[1])
    options.setdefault("timeout_graceful_shutdown", 5)
    options.setdefault("access_log", False)
    if fast:
        protocol: Any = CoalescingHttpToolsProtocol
        if isinstance(app, DirectRoutes):
            protocol = functools.partial(DirectRouteProtocol, routes=app)
        loop = "auto"
    else:
        protocol, loop = "h11", "asyncio"
    return uvicorn.Config(app, host=host, port=port, log_level=log_level,
                          loop=loop, http=protocol, lifespan=lifespan, **options)


@contextlib.asynccontextmanager
async def serve_in_background(
    app: Any, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"
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


