"""The lean HTTP/1.1 client against a raw asyncio server whose framing and connection
handling each test scripts (keep-alive reuse, idle-close retry, chunked and
close-delimited bodies, timeouts), on the default loop and on uvloop."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest
import uvloop

from proxy.upstream.h1 import H1Client, H1Error, H1Timeout, Origin

Handler = Callable[[int, int, bytes], Awaitable[bytes | None]]  # (conn no, request no, head)


class RawServer:
    """Answers each request with what ``handler`` returns (None: close the connection)."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.heads: list[bytes] = []

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        conn_no, request_no = self.connections, 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                head += await reader.readexactly(length)
                self.heads.append(head)
                request_no += 1
                answer = await self.handler(conn_no, request_no, head)
                if answer is None:
                    break
                writer.write(answer)
                await writer.drain()
                if b"connection: close" in answer:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def start(self) -> tuple[asyncio.Server, Origin]:
        server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        return server, Origin.parse(f"http://127.0.0.1:{port}/base")


def _ok(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\nx-a: 1\r\nx-a: 2\r\n\r\n%s" % (
        len(body), body)


async def _get(client: H1Client, origin: Origin, path: str = "/x") -> tuple[int, bytes]:
    resp = await client.request("POST", origin, path, {"x-id": "7"}, b"{}")
    return resp.status, await resp.aread()


async def _keep_alive_and_idle_close_retry() -> None:
    async def handler(conn: int, request: int, head: bytes) -> bytes | None:
        if conn == 1 and request == 3:
            return None  # closed instead of answering: a stale pooled connection
        return _ok(b"hello %d.%d" % (conn, request))

    raw = RawServer(handler)
    server, origin = await raw.start()
    client = H1Client(connect_timeout_s=2, read_timeout_s=2)
    assert await _get(client, origin) == (200, b"hello 1.1")
    assert await _get(client, origin) == (200, b"hello 1.2")
    assert raw.connections == 1
    assert await _get(client, origin) == (200, b"hello 2.1")  # retried on a new connection
    head = raw.heads[0]
    assert head.startswith(b"POST /base/x HTTP/1.1\r\n") and b"x-id: 7\r\n" in head
    assert head.endswith(b"content-length: 2\r\n\r\n{}")
    await client.aclose()
    server.close()


@pytest.mark.parametrize("loop_factory", [asyncio.new_event_loop, uvloop.new_event_loop])
def test_keep_alive_and_idle_close_retry(loop_factory: Callable[[], asyncio.AbstractEventLoop]
                                         ) -> None:
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(_keep_alive_and_idle_close_retry())


async def _framings_and_failures() -> None:
    async def handler(conn: int, request: int, head: bytes) -> bytes | None:
        if b"/chunked" in head:
            return (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
                    b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n")
        if b"/eof" in head:
            return b"HTTP/1.1 503 Busy\r\nconnection: close\r\n\r\nuntil the end"
        if b"/cut" in head:
            return b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\nconnection: close\r\n\r\nabc"
        if b"/slow" in head:
            await asyncio.sleep(1)
        return _ok(b"late")

    raw = RawServer(handler)
    server, origin = await raw.start()
    client = H1Client(connect_timeout_s=2, read_timeout_s=0.2)
    resp = await client.request("GET", origin, "/chunked", {})
    assert (resp.status, resp.headers.get("transfer-encoding")) == (200, "chunked")
    assert await resp.aread() == b"abcde"
    assert await _get(client, origin, "/eof") == (503, b"until the end")
    resp = await client.request("GET", origin, "/cut", {})
    with pytest.raises(H1Error):
        await resp.aread()
    with pytest.raises(H1Timeout):
        await _get(client, origin, "/slow")
    server.close()
    with pytest.raises(H1Error):
        await _get(client, Origin.parse("http://127.0.0.1:9"))
    await client.aclose()


@pytest.mark.parametrize("loop_factory", [asyncio.new_event_loop, uvloop.new_event_loop])
def test_framings_and_failures(loop_factory: Callable[[], asyncio.AbstractEventLoop]) -> None:
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(_framings_and_failures())


def test_repeated_header_joined_and_origin_parsing() -> None:
    async def handler(conn: int, request: int, head: bytes) -> bytes | None:
        return _ok(b"")

    async def main() -> None:
        server, origin = await RawServer(handler).start()
        client = H1Client()
        resp = await client.request("GET", origin, "/", {})
        assert resp.headers["x-a"] == "1, 2"
        await resp.aclose()
        await client.aclose()
        server.close()

    asyncio.run(main())
    assert Origin.parse("https://h.example/v").host_header() == "h.example"
    assert Origin.parse("http://h:8080").port == 8080
    with pytest.raises(ValueError):
        Origin.parse("ftp://h")


async def _connection_slots() -> None:
    release = asyncio.Event()

    async def handler(conn: int, request: int, head: bytes) -> bytes | None:
        if b"/hold" in head:
            await release.wait()
        return _ok(b"done")

    server, origin = await RawServer(handler).start()
    client = H1Client(connect_timeout_s=0.2, max_connections=1)
    held = asyncio.ensure_future(_get(client, origin, "/hold"))
    await asyncio.sleep(0.05)  # the only slot is taken
    with pytest.raises(H1Timeout, match="no free upstream connection"):
        await _get(client, origin)
    release.set()
    assert await held == (200, b"done")
    assert await _get(client, origin) == (200, b"done")  # the slot came back
    await client.aclose()
    server.close()


@pytest.mark.parametrize("loop_factory", [asyncio.new_event_loop, uvloop.new_event_loop])
def test_waiting_for_a_free_connection_times_out(
    loop_factory: Callable[[], asyncio.AbstractEventLoop]
) -> None:
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(_connection_slots())


async def _silent_reused_connection() -> None:
    async def handler(conn: int, request: int, head: bytes) -> bytes | None:
        if request == 2:
            await asyncio.sleep(5)  # accepts the request, never answers in time
        return _ok(b"hi")

    raw = RawServer(handler)
    server, origin = await raw.start()
    client = H1Client(connect_timeout_s=2, read_timeout_s=0.2)
    assert await _get(client, origin) == (200, b"hi")
    with pytest.raises(H1Timeout):
        await _get(client, origin)  # on the pooled connection
    assert (raw.connections, len(raw.heads)) == (1, 2)  # not sent again elsewhere
    await client.aclose()
    server.close()


def test_a_timeout_on_a_pooled_connection_is_not_retried() -> None:
    asyncio.run(_silent_reused_connection())
