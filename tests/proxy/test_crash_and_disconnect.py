"""``kill -9`` of the gateway loses no committed usage; a client that disconnects
mid-stream gets exactly one ledger row with the tokens generated so far; so does a
request cancelled while its upstream works on it, or after the upstream answered but
before the response started."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from billing.models import RequestStatus
from kvtoll.settings import Settings
from tests.proxy.helpers import (
    MODEL,
    LiveServer,
    Tenants,
    build_app,
    free_port,
    ledger_count,
    ledger_rows,
    seed,
    settled_rows,
    wait_until,
)
from tests.proxy.scripted import ScriptedUpstream
from tests.proxy.tcp_proxy import TcpProxy

ROOT = Path(__file__).resolve().parents[2]
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}]}


def _start(url: str, data_dir: Path, port: int, *stream: str) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.proxy.serve_scripted", url, str(data_dir), str(port),
         *stream],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    wait_until(lambda: _alive(port) or proc.poll() is not None, "gateway subprocess", 60)
    assert proc.poll() is None, "gateway subprocess exited"
    return proc


def _alive(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _post(port: int, key: str) -> str:
    response = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=BODY,
                          headers={"Authorization": f"Bearer {key}"}, timeout=30)
    assert response.status_code == 200, response.text
    return response.headers["x-kvtoll-request-id"]


@pytest.mark.postgres
def test_kill_9_loses_no_usage(
    tmp_path: Path, pg_proxy: tuple[TcpProxy, str], direct: sessionmaker[Session]
) -> None:
    proxy, url = pg_proxy
    tenants = seed(direct)
    port = free_port()
    proc = _start(url, tmp_path / "data", port)
    try:
        answered = [_post(port, tenants.key_a) for _ in range(2)]
        settled_rows(direct, 2)
        proxy.stop()
        answered += [_post(port, tenants.key_a) for _ in range(4)]  # into the outbox
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        assert ledger_count(direct) == 2
        proxy.start()
        proc = _start(url, tmp_path / "data", port)  # replays the outbox at startup
        wait_until(lambda: ledger_count(direct) == 6, "replay after restart")
        answered.append(_post(port, tenants.key_b))
        wait_until(lambda: ledger_count(direct) == 7, "ledger row")
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert sorted(r.request_id for r in ledger_rows(direct)) == sorted(answered)


def test_kill_9_mid_stream_bills_what_was_delivered_once(
    tmp_path: Path, sqlite_url: str, db: sessionmaker[Session]
) -> None:
    """SIGKILL while a stream runs: the restart bills the tokens the client received
    (within one journal interval, never more), in one row marked cut."""
    tenants = seed(db)
    port = free_port()
    proc = _start(sqlite_url, tmp_path / "data", port, "400", "0.01")
    received = 0
    try:
        body = {**BODY, "stream": True, "max_tokens": 400}
        headers = {"Authorization": f"Bearer {tenants.key_a}"}
        with httpx.Client(timeout=30) as client, client.stream(
            "POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body, headers=headers
        ) as response:
            request_id = response.headers["x-kvtoll-request-id"]
            lines = response.iter_lines()
            try:
                for line in lines:
                    if line.startswith("data: {") and '"content"' in line:
                        received += 1
                        if received == 40:
                            proc.send_signal(signal.SIGKILL)
            except httpx.HTTPError:
                pass  # the connection ended with the process; everything sent was read
        proc.wait(timeout=30)
        assert ledger_count(db) == 0
        proc = _start(sqlite_url, tmp_path / "data", port)
        wait_until(lambda: ledger_count(db) == 1, "the cut stream's row")
    finally:
        proc.kill()
        proc.wait(timeout=30)
    [row] = ledger_rows(db)
    assert row.request_id == request_id and row.cut
    assert received - 16 <= row.completion_tokens <= received, (row.completion_tokens, received)
    assert row.billed_pico > 0


@pytest.fixture
def slow_server(
    settings: Settings, db: sessionmaker[Session], tenants: Tenants
) -> Iterator[tuple[LiveServer, ScriptedUpstream]]:
    upstream = ScriptedUpstream(num_words=200, delay_s=0.02)
    with LiveServer(build_app(settings, db, upstreams=[upstream])) as server:
        yield server, upstream


def test_client_disconnect_mid_stream(
    slow_server: tuple[LiveServer, ScriptedUpstream], db: sessionmaker[Session],
    tenants: Tenants,
) -> None:
    server, upstream = slow_server
    body = {**BODY, "stream": True, "max_tokens": 200}
    headers = {"Authorization": f"Bearer {tenants.key_a}"}
    received = 0
    with httpx.Client(timeout=30) as client, client.stream(
        "POST", server.url + "/v1/chat/completions", json=body, headers=headers
    ) as response:
        request_id = response.headers["x-kvtoll-request-id"]
        for line in response.iter_lines():
            if line.startswith("data: "):
                received += 1
            if received == 5:
                break  # leaving the block closes the connection mid-stream
    wait_until(lambda: ledger_count(db) == 1, "disconnect row")
    wait_until(lambda: request_id in upstream.aborted, "upstream abort")
    time.sleep(0.2)  # no second row may follow
    [row] = ledger_rows(db)
    assert row.request_id == request_id
    assert row.status is RequestStatus.CLIENT_DISCONNECT
    assert 5 <= row.completion_tokens < 200
    assert row.prompt_tokens > 0 and row.billed_pico > 0


class _Waits(ScriptedUpstream):
    """Takes the request and never answers; ``called`` is set once it has it."""

    def __init__(self) -> None:
        super().__init__()
        self.called = asyncio.Event()

    async def _stream(self, request: Any) -> AsyncIterator[Any]:
        self.seen.append(request)
        self.called.set()
        try:
            await asyncio.Event().wait()
            yield  # never reached
        finally:
            self.aborted.append(request.request_id)


def _scope(key: str, raw: bytes) -> dict[str, Any]:
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": "/v1/chat/completions",
            "raw_path": b"/v1/chat/completions", "query_string": b"", "root_path": "",
            "headers": [(b"authorization", f"Bearer {key}".encode()),
                        (b"content-length", str(len(raw)).encode())],
            "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 50000)}


async def _gone_while_the_head_waits(app: FastAPI, key: str,
                                     body: dict[str, Any]) -> list[dict[str, Any]]:
    """One request through ``app``'s ASGI interface whose response head cannot be
    written (the socket's buffer is full) and whose client then disconnects; returns
    the messages the server tried to send."""
    raw = json.dumps(body).encode()
    messages = [{"type": "http.request", "body": raw, "more_body": False}]
    sent: list[dict[str, Any]] = []
    head_waiting = asyncio.Event()

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop(0)
        await head_waiting.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        head_waiting.set()
        await asyncio.Event().wait()  # never written

    await app(_scope(key, raw), receive, send)
    return sent


async def _cancelled_request(app: FastAPI, key: str, body: dict[str, Any],
                             until: asyncio.Event) -> list[dict[str, Any]]:
    """One request through ``app``'s ASGI interface, its task cancelled once ``until``
    is set (a server that cancels on disconnect or shutdown); returns what was sent."""
    raw = json.dumps(body).encode()
    messages = [{"type": "http.request", "body": raw, "more_body": False}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop(0)
        await asyncio.Event().wait()  # the client stays connected
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    task = asyncio.ensure_future(app(_scope(key, raw), receive, send))
    await until.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    return sent


def test_gone_after_the_upstream_answered_before_the_response_started(
    settings: Settings, db: sessionmaker[Session], tenants: Tenants
) -> None:
    upstream = ScriptedUpstream(num_words=5)
    app = build_app(settings, db, upstreams=[upstream])
    body = {**BODY, "stream": True}
    with TestClient(app):  # lifespan: the outbox drainer runs
        sent = asyncio.run(_gone_while_the_head_waits(app, tenants.key_a, body))
        [row] = settled_rows(db, 1)
    assert [m["type"] for m in sent] == ["http.response.start"]  # and never written
    assert row.request_id == upstream.seen[0].request_id
    assert row.status is RequestStatus.CLIENT_DISCONNECT
    assert row.completion_tokens == 1  # the one delta the upstream had produced
    assert row.prompt_tokens > 0 and row.billed_pico > 0
    assert upstream.aborted == [row.request_id]  # the upstream's work was stopped


@pytest.mark.parametrize("stream", [True, False])
def test_cancelled_while_waiting_for_the_upstream(
    settings: Settings, db: sessionmaker[Session], tenants: Tenants, stream: bool
) -> None:
    async def run() -> list[dict[str, Any]]:
        upstream = _Waits()
        app = build_app(settings, db, upstreams=[upstream])
        with TestClient(app):
            sent = await _cancelled_request(app, tenants.key_a, {**BODY, "stream": stream},
                                            until=upstream.called)
            assert upstream.aborted == [upstream.seen[0].request_id]
            return sent

    assert asyncio.run(run()) == []
    [row] = settled_rows(db, 1)
    assert row.status is RequestStatus.CLIENT_DISCONNECT
    assert (row.prompt_tokens, row.completion_tokens) == (0, 0)
