"""kvtoll.direct_http on a real uvicorn server built by kvtoll.server.uvicorn_config
(fast): an app's direct routes are served without its ASGI entry point, with HTTP/1.1
as uvicorn speaks it (default headers, keep-alive, pipelining, chunked streams,
``Expect: 100-continue``, HTTP/1.0, 500 and closed connections on failures, client
disconnects seen by the handler); everything else reaches the app as before."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import uvicorn

from kvtoll.direct_http import DirectRoutes, Signal
from kvtoll.server import uvicorn_config
from tests.proxy.helpers import free_port

Receive = Any
Send = Any


class App:
    """An ASGI app (answers ``via-asgi``) with direct routes under ``/direct/``."""

    def __init__(self) -> None:
        self.asgi_paths: list[str] = []
        self.disconnected = threading.Event()
        self.routes = {
            b"/direct/echo": self.echo, b"/direct/stream": self.stream,
            b"/direct/fail-before": self.fail_before, b"/direct/fail-after": self.fail_after,
            b"/direct/until-gone": self.until_gone, b"/direct/bad-header": self.bad_header,
        }

    def direct_route(self, method: bytes, raw_path: bytes) -> Any:
        return self.routes.get(raw_path) if method == b"POST" else None

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        self.asgi_paths.append(scope["path"])
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", b"8")]})
        await send({"type": "http.response.body", "body": b"via-asgi"})

    async def echo(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        """The body read in full, with the scope's method, path and query string."""
        body, parts = b"", 0
        while True:
            message = await receive()
            body += message["body"]
            parts += 1
            if not message["more_body"]:
                break
        text = (f"{scope['method']} {scope['path']}?{scope['query_string'].decode()} "
                f"{scope['http_version']} {len(body)}:").encode() + body
        await send({"type": "http.response.start", "status": 201,
                    "headers": [(b"content-length", str(len(text)).encode()),
                                (b"x-parts", str(parts).encode())]})
        await send({"type": "http.response.body", "body": text})

    async def stream(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for frame in (b"one ", b"two ", b"three"):
            await send({"type": "http.response.body", "body": frame, "more_body": True})
            await asyncio.sleep(0.01)
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def fail_before(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        raise RuntimeError("handler failed before answering")

    async def fail_after(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"partial", "more_body": True})
        raise RuntimeError("handler failed mid-response")

    async def bad_header(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", b"0"), (b"x-split", b"a\r\nx-injected: 1")]})

    async def until_gone(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        await receive()  # the body
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"started", "more_body": True})
        while (await receive())["type"] != "http.disconnect":
            pass
        self.disconnected.set()


@contextlib.contextmanager
def serving(app: App, *, access_log: bool = False) -> Iterator[int]:
    port = free_port()
    server = uvicorn.Server(uvicorn_config(app, "127.0.0.1", port, "critical", fast=True,
                                           access_log=access_log))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def post(path: str, body: bytes, *extra: str, version: str = "1.1") -> bytes:
    lines = [f"POST {path} HTTP/{version}", "host: x", f"content-length: {len(body)}", *extra]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


class Reader:
    """Reads HTTP/1.1 responses (content-length or chunked) off one socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = b""

    def _fill(self) -> bool:
        data = self.sock.recv(65536)
        self.buffer += data
        return bool(data)

    def _take_until(self, marker: bytes) -> bytes:
        while marker not in self.buffer:
            assert self._fill(), f"connection closed before {marker!r}"
        head, _, self.buffer = self.buffer.partition(marker)
        return head

    def _take(self, size: int) -> bytes:
        while len(self.buffer) < size:
            assert self._fill(), "connection closed mid-body"
        data, self.buffer = self.buffer[:size], self.buffer[size:]
        return data

    def response(self) -> tuple[int, dict[str, str], bytes]:
        head = self._take_until(b"\r\n\r\n").decode("latin-1").split("\r\n")
        status = int(head[0].split()[1])
        headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in head[1:])}
        if "content-length" in headers:
            return status, headers, self._take(int(headers["content-length"]))
        assert headers.get("transfer-encoding") == "chunked", headers
        body = b""
        while size := int(self._take_until(b"\r\n"), 16):
            body += self._take(size)
            assert self._take(2) == b"\r\n"
        assert self._take(2) == b"\r\n"
        return status, headers, body

    def closed(self) -> bool:
        return not self.buffer and not self._fill()


def connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.settimeout(10)
    return sock


def test_the_app_has_direct_routes() -> None:
    assert isinstance(App(), DirectRoutes)


def test_a_direct_route_answers_in_one_segment_without_the_asgi_app() -> None:
    app = App()
    with serving(app) as port, connect(port) as sock:
        for _ in range(2):  # keep-alive
            sock.sendall(post("/direct/echo?x=1", b'{"a": 1}'))
            data = sock.recv(65536)  # head and body were one write: one segment
            head, _, body = data.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 201 Created\r\n")
            assert body == b"POST /direct/echo?x=1 1.1 8:" + b'{"a": 1}'
            lines = head.lower().split(b"\r\n")
            assert any(line.startswith(b"date: ") for line in lines)  # uvicorn's defaults
            assert b"server: uvicorn" in lines
            assert b"x-parts: 1" in lines
        sock.sendall(post("/other", b"{}"))  # not a direct route: the app
        reader = Reader(sock)
        assert reader.response()[2] == b"via-asgi"
        sock.sendall(b"GET /direct/echo HTTP/1.1\r\nhost: x\r\n\r\n")  # GET: not direct
        assert reader.response()[2] == b"via-asgi"
        sock.sendall(post("/direct%2Fecho", b"{}"))  # percent-encoded: uvicorn's path
        assert reader.response()[2] == b"via-asgi"
    assert app.asgi_paths == ["/other", "/direct/echo", "/direct/echo"]


def test_pipelined_requests_are_answered_in_order() -> None:
    with serving(App()) as port, connect(port) as sock:
        sock.sendall(post("/direct/stream", b"") + post("/direct/echo", b"second")
                     + post("/other", b""))
        reader = Reader(sock)
        assert reader.response()[2] == b"one two three"
        assert reader.response()[2] == b"POST /direct/echo? 1.1 6:second"
        assert reader.response()[2] == b"via-asgi"


def test_a_stream_without_length_is_chunked() -> None:
    with serving(App()) as port, connect(port) as sock:
        sock.sendall(post("/direct/stream", b""))
        status, headers, body = Reader(sock).response()
    assert (status, headers["transfer-encoding"], body) == (200, "chunked", b"one two three")


def test_a_body_in_pieces_and_expect_100_continue() -> None:
    with serving(App()) as port, connect(port) as sock:
        head = post("/direct/echo", b"0123456789", "expect: 100-continue")
        sock.sendall(head[:-10])  # the head only: the server must invite the body
        reader = Reader(sock)
        assert reader._take_until(b"\r\n\r\n") == b"HTTP/1.1 100 Continue"
        sock.sendall(b"01234")
        time.sleep(0.05)
        sock.sendall(b"56789")
        status, headers, body = reader.response()
    assert (status, body) == (201, b"POST /direct/echo? 1.1 10:0123456789")
    assert int(headers["x-parts"]) >= 1


def test_http_1_0_closes_after_the_response() -> None:
    with serving(App()) as port, connect(port) as sock:
        sock.sendall(post("/direct/echo", b"x", version="1.0"))
        reader = Reader(sock)
        status, headers, body = reader.response()
        assert (status, headers["connection"]) == (201, "close")
        assert body == b"POST /direct/echo? 1.0 1:x"
        assert reader.closed()


def test_failures_give_a_500_or_a_closed_connection() -> None:
    with serving(App()) as port:
        with connect(port) as sock:
            sock.sendall(post("/direct/fail-before", b""))
            reader = Reader(sock)
            status, headers, body = reader.response()
            assert (status, headers["connection"], body) == (500, "close", b"Internal Server Error")
            assert reader.closed()
        with connect(port) as sock:
            sock.sendall(post("/direct/fail-after", b""))
            data = b""
            while chunk := sock.recv(65536):  # the server closes the connection
                data += chunk
            assert data.startswith(b"HTTP/1.1 200") and b"partial" in data
            assert not data.endswith(b"0\r\n\r\n")  # never completed


def test_the_handler_sees_the_client_disconnect() -> None:
    app = App()
    with serving(app) as port:
        with connect(port) as sock:
            sock.sendall(post("/direct/until-gone", b"{}"))
            assert b"started" in sock.recv(65536)
        assert app.disconnected.wait(10)


def test_a_header_that_would_split_the_head_is_never_sent() -> None:
    with serving(App()) as port, connect(port) as sock:
        sock.sendall(post("/direct/bad-header", b""))
        assert Reader(sock).closed()  # nothing written, the connection closed


def test_signal_wakes_its_waiters_and_survives_a_cancelled_one() -> None:
    async def run() -> list[str]:
        seen: list[str] = []
        signal = Signal()
        signal.set()
        await signal.wait()  # set: no wait
        seen.append("set before")
        signal.clear()
        assert not signal.is_set()

        async def waiter(name: str) -> None:
            await signal.wait()
            seen.append(name)

        first, second = (asyncio.ensure_future(waiter(n)) for n in ("first", "second"))
        await asyncio.sleep(0)
        first.cancel()  # must not cancel the other waiter
        await asyncio.sleep(0)
        assert seen == ["set before"] and not second.done()
        signal.set()
        await second
        assert first.cancelled()
        return seen

    assert asyncio.run(run()) == ["set before", "second"]


def test_with_the_access_log_on_uvicorn_serves_everything() -> None:
    """The access log (and the forwarded client it names) stays uvicorn's."""
    app = App()
    with serving(app, access_log=True) as port, connect(port) as sock:
        sock.sendall(post("/direct/echo", b"{}"))
        assert Reader(sock).response()[2] == b"via-asgi"
    assert app.asgi_paths == ["/direct/echo"]
