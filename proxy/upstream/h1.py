"""A lean keep-alive HTTP/1.1 client for the upstream hot path (asyncio + httptools).

Why not httpx: on the gateway's per-request path httpx/httpcore/h11/anyio cost about
1.5 ms of CPU per proxied completion (request model, header normalisation, pure
Python h11 parsing, anyio stream wrappers); this client writes the request in one
``transport.write`` and parses the response with httptools (C, the parser uvicorn
uses), ~0.3 ms. It does only what :class:`~proxy.upstream.http.HttpUpstream` needs:
one request per connection at a time, pooled per origin, ``Content-Length`` request
bodies, any response framing httptools understands (length, chunked, close),
connect and read (between two bytes) timeouts, ``http`` and ``https``.

A pooled connection that the server closed while idle (keep-alive race) is retried
once on a fresh connection when nothing of the response arrived. Closing a response
before its end closes the connection, which aborts the upstream's work.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import cast
from urllib.parse import urlsplit

import httptools

_PAUSE_BYTES = 1 << 18  # stop reading from the socket while this much is unconsumed


class H1Error(Exception):
    """The connection failed, or the response was malformed."""


class H1Timeout(H1Error):
    """Connecting or waiting for the next bytes took longer than allowed."""


@dataclass(frozen=True)
class Origin:
    """Where to connect: scheme, host, port (and the path prefix of a base URL)."""

    scheme: str
    host: str
    port: int
    prefix: str

    @classmethod
    def parse(cls, url: str) -> Origin:
        """``http(s)://host[:port][/prefix]``."""
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        return cls(parts.scheme, parts.hostname, port, parts.path.rstrip("/"))

    def host_header(self) -> str:
        default = 443 if self.scheme == "https" else 80
        return self.host if self.port == default else f"{self.host}:{self.port}"


class _Conn(asyncio.Protocol):
    """One connection; parses one response at a time (httptools callbacks)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._waiter: asyncio.Future[None] | None = None
        # read timeout: one timer handle per connection, re-armed only when it fires
        # before the current wait's deadline (no handle scheduled and cancelled per wait)
        self._loop = asyncio.get_running_loop()
        self._timer: asyncio.TimerHandle | None = None
        self._deadline = 0.0
        self._timeout_s = 0.0
        self._reset()

    def _reset(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.headers: dict[str, str] = {}
        self.headers_done = self.complete = self.keep_alive = self.received = False
        self.chunks: deque[bytes] = deque()
        self.buffered = 0
        self.error: BaseException | None = None

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.received = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.error = H1Error(f"malformed response: {exc}")
            self.close()
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.headers_done and not self.complete and self._framed_by_close():
            self.complete = True  # a body delimited by the end of the connection
        if not self.complete and self.error is None:
            self.error = H1Error(f"connection closed: {exc!r}" if exc else "connection closed")
        self._wake()

    def _framed_by_close(self) -> bool:
        return "content-length" not in self.headers and "chunked" not in self.headers.get(
            "transfer-encoding", "").lower()

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        key = name.decode("latin-1").lower()
        text = value.decode("latin-1")
        self.headers[key] = f"{self.headers[key]}, {text}" if key in self.headers else text

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.headers_done = True

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > _PAUSE_BYTES and self.transport is not None:
            self.transport.pause_reading()

    def on_message_complete(self) -> None:
        self.complete = True
        self.keep_alive = self.parser.should_keep_alive()

    # used by the client
    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def wait(self, timeout_s: float) -> None:
        """Until new bytes were parsed or the connection ended (:class:`H1Timeout` after
        ``timeout_s`` without either)."""
        if self.error is not None:
            raise self.error
        self._waiter = waiter = self._loop.create_future()
        self._timeout_s = timeout_s
        self._deadline = self._loop.time() + timeout_s
        if self._timer is None:
            self._timer = self._loop.call_at(self._deadline, self._on_timer)
        try:
            await waiter
        finally:
            self._waiter = None

    def _on_timer(self) -> None:
        self._timer = None
        waiter = self._waiter
        if waiter is None or waiter.done():
            return  # not waiting: the next wait schedules a handle again
        if self._loop.time() < self._deadline:
            self._timer = self._loop.call_at(self._deadline, self._on_timer)
            return
        waiter.set_exception(H1Timeout(f"no data for {self._timeout_s:g} s"))

    def send(self, data: bytes) -> None:
        self._reset()
        assert self.transport is not None
        self.transport.write(data)

    def take(self) -> bytes:
        data = b"".join(self.chunks)
        self.chunks.clear()
        if self.buffered > _PAUSE_BYTES and self.transport is not None:
            self.transport.resume_reading()
        self.buffered = 0
        return data

    def close(self) -> None:
        self.closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.transport is not None:
            self.transport.close()


class H1Response:
    """Status, headers (lower-case names) and the body as it arrives."""

    def __init__(self, client: H1Client, origin: Origin, conn: _Conn, read_timeout_s: float):
        self._client, self._origin, self._conn = client, origin, conn
        self._read_timeout_s = read_timeout_s
        self._released = False
        self.status = conn.status
        self.headers: Mapping[str, str] = conn.headers

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        """Body chunks until the response ends."""
        conn = self._conn
        while True:
            if conn.chunks:
                yield conn.take()
            elif conn.complete:
                self._release()
                return
            else:
                await conn.wait(self._read_timeout_s)

    async def aread(self) -> bytes:
        """The whole (rest of the) body."""
        return b"".join([chunk async for chunk in self.aiter_bytes()])

    def _release(self) -> None:
        if self._released:
            return
        self._released = True
        reusable = self._conn.complete and self._conn.keep_alive and not self._conn.closed
        self._client.release(self._origin, self._conn, reusable)

    async def aclose(self) -> None:
        """Give the connection back (closed unless the response was read to its end)."""
        self._release()


def request_head(method: str, origin: Origin, path: str, headers: Mapping[str, str]) -> bytes:
    """The request line, ``host`` and ``headers``, each line ending in CRLF, without the
    blank line that ends the head (more headers may follow)."""
    lines = [f"{method} {origin.prefix}{path} HTTP/1.1", f"host: {origin.host_header()}"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n").encode("latin-1")


class H1Client:
    """Keep-alive connections per origin; at most ``max_connections`` in use at once."""

    def __init__(self, *, connect_timeout_s: float = 5.0, read_timeout_s: float = 300.0,
                 max_connections: int = 256, ssl_context: ssl.SSLContext | None = None) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self._slots = asyncio.BoundedSemaphore(max_connections)
        self._idle: dict[Origin, list[_Conn]] = {}
        self._ssl = ssl_context  # https: this context, else the system's default one

    async def request(self, method: str, origin: Origin, path: str,
                      headers: Mapping[str, str], body: bytes = b"", *,
                      read_timeout_s: float | None = None) -> H1Response:
        """Send one request; returns once the response headers arrived. The caller must
        read the body to its end or ``aclose`` the response."""
        head = request_head(method, origin, path, headers)
        if body or method not in ("GET", "HEAD"):
            head += b"content-length: %d\r\n" % len(body)
        return await self.send(origin, head + b"\r\n" + body, read_timeout_s=read_timeout_s)

    async def send(self, origin: Origin, data: bytes, *,
                   read_timeout_s: float | None = None) -> H1Response:
        """:meth:`request` with the request already encoded (``data``: the head, from
        :func:`request_head` plus any per-request headers, a blank line, the body)."""
        timeout = self.read_timeout_s if read_timeout_s is None else read_timeout_s
        if self._slots.locked():  # all connections busy: wait, but not forever
            try:
                async with asyncio.timeout(self.connect_timeout_s):
                    await self._slots.acquire()
            except TimeoutError:
                raise H1Timeout("no free upstream connection") from None
        else:
            await self._slots.acquire()  # immediate
        try:
            return await self._exchange(origin, data, timeout)
        except BaseException:
            self._slots.release()
            raise

    async def _exchange(self, origin: Origin, data: bytes, timeout_s: float) -> H1Response:
        conn, reused = await self._acquire(origin)
        try:
            return await self._headers(origin, conn, data, timeout_s)
        except H1Error as exc:
            # a silent server (timeout) is not a stale connection: no second wait
            if not (reused and not conn.received) or isinstance(exc, H1Timeout):
                raise
        finally:
            if not conn.headers_done:
                conn.close()
        conn = await self._connect(origin)  # the server closed the idle connection: retry
        try:
            return await self._headers(origin, conn, data, timeout_s)
        finally:
            if not conn.headers_done:
                conn.close()

    async def _headers(self, origin: Origin, conn: _Conn, data: bytes,
                       timeout_s: float) -> H1Response:
        conn.send(data)
        while not conn.headers_done:
            await conn.wait(timeout_s)
        return H1Response(self, origin, conn, timeout_s)

    async def _acquire(self, origin: Origin) -> tuple[_Conn, bool]:
        idle = self._idle.get(origin)
        while idle:
            conn = idle.pop()
            if not conn.closed and conn.transport is not None and not conn.transport.is_closing():
                return conn, True
        return await self._connect(origin), False

    async def _connect(self, origin: Origin) -> _Conn:
        loop = asyncio.get_running_loop()
        context = None
        if origin.scheme == "https":
            self._ssl = self._ssl or ssl.create_default_context()
            context = self._ssl
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(
                    _Conn, origin.host, origin.port, ssl=context,
                    server_hostname=origin.host if context else None,
                )
        except TimeoutError:
            raise H1Timeout(f"connect to {origin.host}:{origin.port} timed out") from None
        except OSError as exc:
            raise H1Error(f"connect to {origin.host}:{origin.port} failed: {exc}") from exc
        return conn

    def release(self, origin: Origin, conn: _Conn, reusable: bool) -> None:
        """Back to the pool (``reusable``) or closed; frees the slot either way."""
        self._slots.release()
        if reusable:
            self._idle.setdefault(origin, []).append(conn)
        else:
            conn.close()

    async def aclose(self) -> None:
        """Close idle connections."""
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()
