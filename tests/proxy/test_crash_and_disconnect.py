"""``kill -9`` of the gateway loses no committed usage; a client that disconnects
mid-stream gets exactly one ledger row with the tokens generated so far."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy.orm import Session, sessionmaker

from billing.models import RequestStatus
from proxy.settings import Settings
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


def _start(url: str, data_dir: Path, port: int) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.proxy.serve_scripted", url, str(data_dir), str(port)],
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
