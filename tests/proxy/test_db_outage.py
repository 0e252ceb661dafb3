"""PostgreSQL unreachable during traffic: requests are still answered, usage goes to the
outbox and is replayed when the database is back; ledger rows = successful responses."""

from __future__ import annotations

import httpx
import openai
import pytest
from sqlalchemy.orm import Session, sessionmaker

from billing.db import make_engine, session_factory
from kvtoll.settings import Settings
from proxy.config import ProxyConfig
from tests.proxy.helpers import (
    ADMIN,
    MODEL,
    LiveServer,
    build_app,
    ledger_count,
    ledger_rows,
    seed,
    settled_rows,
    wait_until,
)
from tests.proxy.scripted import ScriptedUpstream
from tests.proxy.tcp_proxy import TcpProxy

pytestmark = pytest.mark.postgres
FAST = ProxyConfig(ledger_retry_interval_s=0.1)


def test_pg_outage_during_traffic(
    settings: Settings, pg_proxy: tuple[TcpProxy, str], direct: sessionmaker[Session]
) -> None:
    proxy, proxied_url = pg_proxy
    tenants = seed(direct)
    engine = make_engine(proxied_url)
    app = build_app(settings, session_factory(engine), upstreams=[ScriptedUpstream()],
                    config=FAST)
    request_ids: list[str] = []
    with LiveServer(app) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=tenants.key_a, max_retries=0)

        def chat(stream: bool = False) -> None:
            messages = [{"role": "user", "content": "hi"}]
            if stream:
                with client.chat.completions.with_streaming_response.create(
                    model=MODEL, messages=messages, stream=True  # type: ignore[arg-type]
                ) as response:
                    list(response.iter_lines())
                    request_ids.append(response.headers["x-kvtoll-request-id"])
                return
            raw = client.chat.completions.with_raw_response.create(
                model=MODEL, messages=messages  # type: ignore[arg-type]
            )
            assert raw.parse().choices[0].message.content
            request_ids.append(raw.headers["x-kvtoll-request-id"])

        for _ in range(3):
            chat()
        settled_rows(direct, 3)

        proxy.stop()  # the database is now unreachable for the gateway
        for i in range(6):
            chat(stream=i % 2 == 1)
        state = app.state.kvtoll
        assert state.outbox.depth() == 6
        assert ledger_count(direct) == 3
        ready = httpx.get(server.url + "/readyz").json()
        assert ready["ledger"] == "outbox"
        depth = httpx.get(server.url + "/metrics", headers=ADMIN).text
        assert "kvtoll_outbox_depth 6.0" in depth

        proxy.start()  # back: the background replay drains the outbox
        wait_until(lambda: state.outbox.depth() == 0, "outbox replay")
        wait_until(lambda: "kvtoll_outbox_depth 0.0"
                   in httpx.get(server.url + "/metrics", headers=ADMIN).text,
                   "outbox depth metric")
        chat()
    engine.dispose()
    rows = ledger_rows(direct)
    assert sorted(r.request_id for r in rows) == sorted(request_ids)
    assert len(rows) == 10
    assert all(r.billed_pico > 0 and r.status.value == "ok" for r in rows)


def test_pg_blackholed_known_keys_served_readyz_names_database(
    settings: Settings, pg_proxy: tuple[TcpProxy, str], direct: sessionmaker[Session]
) -> None:
    """Packets dropped, not refused: a key seen before keeps being served and metered
    after recovery; a never-seen key gets 503 with Retry-After; /readyz says the
    database is down (without waiting on it); everything is billed once it is back."""
    proxy, proxied_url = pg_proxy
    tenants = seed(direct)
    engine = make_engine(proxied_url)
    config = ProxyConfig(ledger_retry_interval_s=0.1, auth_cache_ttl_s=0.0, auth_wait_s=0.5,
                         probe_interval_s=0.1, probe_timeout_s=0.3)
    app = build_app(settings, session_factory(engine), upstreams=[ScriptedUpstream()],
                    config=config)
    headers = {"Authorization": f"Bearer {tenants.key_a}"}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    ok_ids: list[str] = []
    with LiveServer(app) as server:
        url = server.url + "/v1/chat/completions"
        first = httpx.post(url, json=body, headers=headers, timeout=30)
        assert first.status_code == 200
        ok_ids.append(first.headers["x-kvtoll-request-id"])
        settled_rows(direct, 1)
        proxy.blackhole()
        wait_until(lambda: "database" in httpx.get(server.url + "/readyz").json()["down"],
                   "readyz noticing the blackhole")
        ready = httpx.get(server.url + "/readyz")
        assert ready.status_code == 503
        for _ in range(4):  # TTL 0: every request re-checks; none waits for the answer
            response = httpx.post(url, json=body, headers=headers, timeout=30)
            assert response.status_code == 200
            ok_ids.append(response.headers["x-kvtoll-request-id"])
        unknown = httpx.post(url, json=body, timeout=30,
                             headers={"Authorization": f"Bearer {tenants.key_b}"})
        assert unknown.status_code == 503
        assert unknown.headers["retry-after"] == "1"
        assert unknown.json()["error"]["code"] == "service_unavailable"
        proxy.start()
        wait_until(lambda: httpx.get(server.url + "/readyz").status_code == 200, "recovery")
        wait_until(lambda: app.state.kvtoll.outbox.depth() == 0, "outbox replay")
    engine.dispose()
    assert sorted(r.request_id for r in ledger_rows(direct)) == sorted(ok_ids)
