"""kvtoll.server: writes within one event-loop step leave in one ``write`` of the real
transport, in order; nothing is held past the step; close flushes, abort drops; and a
real uvicorn server with this protocol answers keep-alive requests in one segment."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

from fastapi import FastAPI

from kvtoll.coalescing import CoalescingTransport
from tests.proxy.helpers import LiveServer


class Recorder(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []
        self.events: list[str] = []
        self.closing = False

    def write(self, data: Any) -> None:
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closing

    def get_write_buffer_size(self) -> int:
        return 0

    def close(self) -> None:
        self.events.append("close")
        self.closing = True

    def abort(self) -> None:
        self.events.append("abort")
        self.closing = True


def test_writes_of_one_step_are_joined_and_flushed_at_its_end() -> None:
    async def run() -> list[list[bytes]]:
        inner = Recorder()
        transport = CoalescingTransport(inner, asyncio.get_running_loop())
        seen = []
        transport.write(b"head ")
        seen.append(list(inner.writes))  # held
        transport.write(b"body")
        seen.append(list(inner.writes))  # joined with the held write
        transport.write(b"frame1 ")
        seen.append(list(inner.writes))  # held again
        await asyncio.sleep(0)  # the step ends: flushed
        seen.append(list(inner.writes))
        transport.writelines([b"a", b"b"])
        await asyncio.sleep(0)
        seen.append(list(inner.writes))
        return seen

    held, joined, held_again, flushed, lines = asyncio.run(run())
    assert held == []
    assert joined == [b"head body"]
    assert held_again == [b"head body"]
    assert flushed == [b"head body", b"frame1 "]
    assert lines == [b"head body", b"frame1 ", b"ab"]


def test_close_flushes_first_and_abort_drops() -> None:
    async def run() -> tuple[Recorder, Recorder]:
        loop = asyncio.get_running_loop()
        closed, aborted = Recorder(), Recorder()
        first = CoalescingTransport(closed, loop)
        first.write(b"last words")
        assert first.get_write_buffer_size() == len(b"last words")
        first.close()
        second = CoalescingTransport(aborted, loop)
        second.write(b"never sent")
        second.abort()
        await asyncio.sleep(0)  # the scheduled flushes find nothing (or a closed transport)
        return closed, aborted

    closed, aborted = asyncio.run(run())
    assert (closed.writes, closed.events) == ([b"last words"], ["close"])
    assert (aborted.writes, aborted.events) == ([], ["abort"])


def test_live_server_answers_head_and_body_in_one_segment() -> None:
    """Two keep-alive requests on one connection; each answer is complete in the first
    ``recv`` (head and body were one write; loopback delivers it as one segment)."""
    app = FastAPI()

    @app.get("/ping")
    async def ping() -> dict[str, str]:
        return {"pong": "yes"}

    with LiveServer(app) as live, socket.create_connection(("127.0.0.1", live.port)) as sock:
        sock.settimeout(10)
        for _ in range(2):
            sock.sendall(b"GET /ping HTTP/1.1\r\nhost: x\r\n\r\n")
            data = sock.recv(65536)
            head, _, body = data.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200")
            assert body == b'{"pong":"yes"}'
