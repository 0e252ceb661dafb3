"""Building servers: every kvtoll HTTP server (gateway, worker, tests' and benchmarks'
background servers) runs under uvicorn with the settings of :func:`uvicorn_config`.

The gateway's servers (``fast=True``) use httptools and uvloop, and coalesce writes:
uvicorn writes a response's status line and headers (``http.response.start``) and its
body in two ``write`` calls, so two TCP segments. On a busy host the first one wakes
the client, which may take the CPU from the gateway before the second is written: a
whole JSON answer then reaches the client one scheduling delay later (measured on a
loaded 2-core machine: 0.9 ms at p50 between the two writes).
:class:`CoalescingTransport` holds each write until the next one or the end of the
current event-loop step, so a response written in one step (head and body, or
several SSE frames) leaves in one ``send``; nothing is held past that step.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import socket
from collections.abc import AsyncIterator
from typing import Any, Literal

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class CoalescingTransport(asyncio.Transport):
    """Delegates to ``transport``; consecutive writes within one loop step are joined
    (the first is held until the second arrives or the step ends)."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self._transport = transport
        self._loop = loop
        self._held: bytes | None = None

    def write(self, data: bytes | bytearray | memoryview) -> None:
        held = self._held
        if held is None:
            self._held = bytes(data)
            self._loop.call_soon(self.flush)
            return
        self._held = None
        self._transport.write(held + bytes(data))

    def writelines(self, list_of_data: Any) -> None:
        self.write(b"".join(list_of_data))

    def flush(self) -> None:
        """Write what is held now (called at the end of the step it was written in)."""
        held, self._held = self._held, None
        if held is not None and not self._transport.is_closing():
            self._transport.write(held)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def abort(self) -> None:
        self._held = None
        self._transport.abort()

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def can_write_eof(self) -> bool:
        return self._transport.can_write_eof()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._transport.get_extra_info(name, default)

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._transport.set_protocol(protocol)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._transport.get_protocol()

    def is_reading(self) -> bool:
        return self._transport.is_reading()

    def pause_reading(self) -> None:
        self._transport.pause_reading()

    def resume_reading(self) -> None:
        self._transport.resume_reading()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._transport.set_write_buffer_limits(high, low)

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + len(self._held or b"")

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._transport.get_write_buffer_limits()


class CoalescingHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol writing through a :class:`CoalescingTransport`."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(CoalescingTransport(transport, self.loop))


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
    gateway). ``lifespan="on"`` for an app that starts its background loops there;
    ``tls``: serve https with that (certificate, private key) pair."""
    if tls is not None:
        options.update(ssl_certfile=tls[0], ssl_keyfile=tls[1])
    options.setdefault("timeout_graceful_shutdown", 5)
    options.setdefault("access_log", False)
    if fast:
        protocol: Any = CoalescingHttpToolsProtocol
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


