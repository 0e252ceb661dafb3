"""Admin API for budgets: set, list with spend, remove; bad input is a 4xx in OpenAI's
shape; a budget set through it reaches the gateway on the next refresh."""

from __future__ import annotations

import httpx
from sqlalchemy.orm import Session, sessionmaker

from kvtoll.settings import Settings
from proxy.config import ProxyConfig
from tests.proxy.helpers import (
    ADMIN,
    ADMIN_TOKEN,
    LiveServer,
    build_app,
    seed,
    settled_rows,
    wait_until,
)
from tests.proxy.scripted import ScriptedUpstream
from tests.proxy.test_budget import _chat

QUICK = ProxyConfig(auth_cache_ttl_s=0.2)  # budgets reload every 0.2 s


def test_budget_admin_api_and_the_gateway_applying_it(
    settings: Settings, db: sessionmaker[Session]
) -> None:
    tenants = seed(db)
    app = build_app(settings, db, upstreams=[ScriptedUpstream()], config=QUICK)
    admin_headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    with LiveServer(app) as server, httpx.Client(base_url=server.url, timeout=30) as client:
        assert _chat(client, tenants.key_a).status_code == 200  # 17e6 spent, no budget yet
        settled_rows(db, 1)
        made = client.post("/admin/budgets", headers=admin_headers,
                           json={"tenant": "acme", "monthly_usd": "0.00001", "alert_at": "0.5"})
        assert made.status_code == 201, made.text
        assert made.json() == {**made.json(), "tenant": "acme", "key_id": None,
                               "monthly_usd": "0.00001", "alert_at": "0.5"}
        keyed = client.post("/admin/budgets", headers=admin_headers,
                            json={"tenant": "acme", "key_id": tenants.key_a_id,
                                  "monthly_usd": "5"})
        assert keyed.status_code == 201 and keyed.json()["alert_at"] == "0.8"
        listed = client.get("/admin/budgets", headers=admin_headers).json()["data"]
        assert [(b["key_id"], b["spent_usd"], b["state"]) for b in listed] == [
            (None, "0.000017", "exceeded"), (tenants.key_a_id, "0.000017", "ok"),
        ]
        wait_until(lambda: _chat(client, tenants.key_a).status_code == 429, "the budget applied")
        for body, status in (
            ({"tenant": "acme", "monthly_usd": "-1"}, 400),
            ({"tenant": "acme", "monthly_usd": 5}, 400),  # a number, not a decimal string
            ({"tenant": "acme", "monthly_usd": "1", "alert_at": "0"}, 400),
            ({"tenant": "nobody", "monthly_usd": "1"}, 404),
            ({"tenant": "acme", "monthly_usd": "1", "extra": 1}, 400),
        ):
            refused = client.post("/admin/budgets", headers=admin_headers, json=body)
            assert refused.status_code == status, (body, refused.text)
            assert set(refused.json()["error"]) == {"message", "type", "param", "code"}
        assert client.post("/admin/budgets", json={"tenant": "acme", "monthly_usd": "1"},
                           ).status_code == 401
        gone = client.delete("/admin/budgets/acme", headers=admin_headers)
        assert gone.status_code == 204
        assert client.delete("/admin/budgets/acme", headers=admin_headers).status_code == 404
        wait_until(lambda: _chat(client, tenants.key_a).status_code == 200, "the budget removed")
        metrics = client.get("/metrics", headers=ADMIN).text
    assert 'kvtoll_budget_used_ratio{key="",tenant="acme"}' not in metrics
    assert f'kvtoll_budget_used_ratio{{key="{tenants.key_a_id}",tenant="acme"}}' in metrics
