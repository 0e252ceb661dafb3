"""Direct routes: requests an app answers without uvicorn's ASGI request cycle.

uvicorn runs every request through the same machinery: a ``RequestResponseCycle``
with its event, the proxy-headers middleware, the app's own dispatch, and a ``send``
that checks every response header with two regular expressions and writes the head
and the body separately (joined again by :class:`~kvtoll.coalescing.CoalescingTransport`
one loop step later). On the gateway's completion paths that is ~10% of the CPU a
request costs (py-spy, 32 clients). :class:`DirectRouteProtocol` is uvicorn's
httptools protocol (connection handling, keep-alive, pipelining, flow control,
graceful shutdown unchanged) that asks the app, once a request's head is parsed,
whether it serves that method and path directly (:class:`DirectRoutes`); if so the
request runs in a :class:`DirectCycle`::

    bytes ─► httptools ─► on_headers_complete ─┬─ app.direct_route(method, raw path)
                                               │    → an ASGI callable: DirectCycle
                                               │      (lean receive/send; head and a
                                               │      whole body in one write)
                                               └─ None → uvicorn's cycle, middleware,
                                                  the app (everything else)

A direct route is still an ASGI callable, called with the scope uvicorn would give it
(``client`` and ``scheme`` as connected: no ``X-Forwarded-*`` rewriting, which only
the app's other routes and the access log read); responses carry uvicorn's default
headers (``date``, ``server``), ``Expect: 100-continue`` is answered, a response
without ``content-length`` is chunked, a handler that fails before answering gets
uvicorn's 500 and one that fails mid-response a closed connection. With the access log
on (it costs more than a request), or for a request with a ``root_path``, a
percent-encoded path, an upgrade or under a concurrency limit, uvicorn's path serves it
all, proxy headers and log lines included.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, runtime_checkable

import httptools
from uvicorn.protocols.http.httptools_impl import HEADER_RE, HEADER_VALUE_RE, STATUS_LINE

from kvtoll.coalescing import CoalescingHttpToolsProtocol, CoalescingTransport

ASGIApp = Callable[[dict[str, Any], Any, Any], Awaitable[None]]
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_DISCONNECT = {"type": "http.disconnect"}
_ERROR_500 = (STATUS_LINE[500] + b"content-type: text/plain; charset=utf-8\r\n"
              b"content-length: 21\r\nconnection: close\r\n\r\nInternal Server Error")
_HEADER_END = b"\r\n"


@runtime_checkable
class DirectRoutes(Protocol):
    """An app with routes served directly (:class:`DirectRouteProtocol`)."""

    def direct_route(self, method: bytes, raw_path: bytes) -> ASGIApp | None:
        """The ASGI callable that serves ``method`` on ``raw_path`` directly, or None
        for the app's usual handling."""
        ...


class DirectCycle:
    """One request on a direct route. Has what uvicorn's protocol reads and writes on
    its current cycle (``body``, ``more_body``, ``message_event``, ``keep_alive``,
    ``response_complete``, ``disconnected``, ``run_asgi``), so parsing, pipelining,
    disconnects and shutdown work as for uvicorn's own cycle."""

    def __init__(self, scope: dict[str, Any], transport: CoalescingTransport, flow: Any,
                 default_headers: list[tuple[bytes, bytes]], *, expect_100_continue: bool,
                 keep_alive: bool, on_response: Callable[[], None]) -> None:
        self.scope = scope
        self.transport = transport
        self.flow = flow
        self.default_headers = default_headers
        self.waiting_for_100_continue = expect_100_continue
        self.keep_alive = keep_alive
        self.on_response = on_response
        self.message_event = Signal()
        self.body = b""  # the protocol appends (``+=``); one chunk stays that chunk
        self.more_body = True
        self.disconnected = False
        self.response_started = False
        self.response_complete = False
        self.chunked = False
        self.expected_length = 0
        self._head: bytes | None = None  # written with the first body part

    async def run_asgi(self, app: ASGIApp) -> None:
        """Run ``app`` on this request (uvicorn's checks on what it did)."""
        try:
            await app(self.scope, self.receive, self.send)
        except BaseException:
            logging.getLogger("uvicorn.error").exception("Exception in ASGI application")
            self._fail()
        else:
            if not self.response_complete and not self.disconnected:
                logging.getLogger("uvicorn.error").error(
                    "ASGI callable returned without %s response.",
                    "completing" if self.response_started else "starting")
                self._fail()
        finally:
            self.on_response = _nothing

    def _fail(self) -> None:
        if not self.response_started and not self.disconnected:
            self.response_started = self.response_complete = True
            self.transport.write_now(_ERROR_500)
            self.transport.close()
        elif not self.response_complete:
            self.transport.close()

    async def receive(self) -> dict[str, Any]:
        """The request body (one message per arrival), then ``http.disconnect``."""
        if self.waiting_for_100_continue and not self.transport.is_closing():
            self.transport.write_now(_CONTINUE)
            self.waiting_for_100_continue = False
        if not self.disconnected and not self.response_complete:
            self.flow.resume_reading()
            await self.message_event.wait()
            self.message_event.clear()
        if self.disconnected or self.response_complete:
            return _DISCONNECT
        message = {"type": "http.request", "body": self.body, "more_body": self.more_body}
        self.body = b""
        return message

    async def send(self, message: dict[str, Any]) -> None:
        """``http.response.start`` (held), then ``http.response.body`` parts."""
        if self.flow.write_paused and not self.disconnected:
            await self.flow.drain()
        if self.disconnected:
            return
        if not self.response_started:
            if message["type"] != "http.response.start":
                raise RuntimeError(f"Expected 'http.response.start', got '{message['type']}'")
            self.response_started = True
            self.waiting_for_100_continue = False
            self._head = self._render_head(message["status"], message.get("headers", ()))
            return
        if self.response_complete:
            raise RuntimeError(f"Unexpected '{message['type']}' after the response completed")
        if message["type"] != "http.response.body":
            raise RuntimeError(f"Expected 'http.response.body', got '{message['type']}'")
        body = message.get("body", b"")
        more_body = message.get("more_body", False)
        data = self._frame(body, more_body)
        if self._head is not None:
            data, self._head = self._head + data, None
        if more_body:
            self.transport.write(data)  # frames of one loop step leave together
            return
        self.transport.write_now(data)
        self.response_complete = True
        self.message_event.set()
        if not self.keep_alive:
            self.transport.close()
        self.on_response()

    def _render_head(self, status: int, headers: Any) -> bytes:
        content = [STATUS_LINE[status]]
        length: int | None = None
        # the app's names and values checked at once (joining adds no character the
        # checks refuse); uvicorn's own default headers were checked when it built them
        if (HEADER_RE.search(b"".join(name for name, _ in headers))
                or HEADER_VALUE_RE.search(b"".join(value for _, value in headers))):
            raise RuntimeError(f"Invalid HTTP header in {list(headers)!r}")
        for name, value in (*self.default_headers, *headers):
            name = name.lower()
            if name == b"content-length" and length is None:
                length = int(value)
            elif name == b"connection" and b"close" in value.lower():
                self.keep_alive = False
            content += (name, b": ", value, _HEADER_END)
        if not self.keep_alive:
            content.append(b"connection: close\r\n")
        if length is None and status not in (204, 304):
            self.chunked = True
            content.append(b"transfer-encoding: chunked\r\n")
        self.expected_length = length or 0
        content.append(_HEADER_END)
        return b"".join(content)

    def _frame(self, body: bytes, more_body: bool) -> bytes:
        if self.chunked:
            data = b"%x\r\n%b\r\n" % (len(body), body) if body else b""
            return data if more_body else data + b"0\r\n\r\n"
        self.expected_length -= len(body)
        if self.expected_length < 0:
            raise RuntimeError("Response content longer than Content-Length")
        if not more_body and self.expected_length:
            raise RuntimeError("Response content shorter than Content-Length")
        return body


def _nothing() -> None:
    return None


class Signal:
    """What the protocol and :meth:`DirectCycle.receive` use of ``asyncio.Event``
    (``set``, ``clear``, ``wait``), with a future made only when ``wait`` must wait:
    most requests arrive whole, so their body is there before anyone waits."""

    __slots__ = ("_set", "_waiter")

    def __init__(self) -> None:
        self._set = False
        self._waiter: asyncio.Future[None] | None = None

    def set(self) -> None:
        self._set = True
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def clear(self) -> None:
        self._set = False

    def is_set(self) -> bool:
        return self._set

    async def wait(self) -> None:
        """Until :meth:`set` (now if it is set); waiters at the same time share one future."""
        if self._set:
            return
        waiter = self._waiter
        if waiter is None or waiter.done():
            waiter = self._waiter = asyncio.get_running_loop().create_future()
        await asyncio.shield(waiter)  # a cancelled waiter leaves the future to the others


class DirectRouteProtocol(CoalescingHttpToolsProtocol):
    """uvicorn's (coalescing) httptools protocol with ``routes``' direct routes (see
    module doc). Built per connection by uvicorn: pass it as
    ``functools.partial(DirectRouteProtocol, routes=app)``."""

    def __init__(self, *args: Any, routes: DirectRoutes, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._routes = routes
        # with the access log on, uvicorn's path logs every request (forwarded client too)
        self._direct = not self.access_log

    def on_headers_complete(self) -> None:
        parser = self.parser
        route = url = None
        if (self._direct and not self.root_path and self.limit_concurrency is None
                and not parser.should_upgrade()):
            url = httptools.parse_url(self.url)
            route = self._routes.direct_route(parser.get_method(), url.path)
        if route is None or url is None:
            super().on_headers_complete()
            return
        self._start_direct(route, url.path, url.query or b"")

    def _start_direct(self, route: ASGIApp, raw_path: bytes, query: bytes) -> None:
        parser = self.parser
        scope: dict[str, Any] = self.scope  # type: ignore[assignment]
        http_version = parser.get_http_version()
        scope["method"] = parser.get_method().decode("ascii")
        if http_version != "1.1":
            scope["http_version"] = http_version
        scope["path"] = raw_path.decode("ascii")
        scope["raw_path"] = raw_path
        scope["query_string"] = query
        existing = self.cycle
        cycle = DirectCycle(
            scope, self.transport, self.flow,  # type: ignore[arg-type]
            self.server_state.default_headers,
            expect_100_continue=self.expect_100_continue,
            keep_alive=http_version != "1.0" and parser.should_keep_alive(),
            on_response=self.on_response_complete)
        self.cycle = cycle  # type: ignore[assignment]
        if existing is None or existing.response_complete:
            self._start_asgi_task(cycle, route)  # type: ignore[arg-type]
        else:  # pipelined behind a response still being written
            self.flow.pause_reading()
            self.pipeline.appendleft((cycle, route))  # type: ignore[arg-type]
