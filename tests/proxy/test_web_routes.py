"""The gateway serves the web dashboards and usage APIs next to the OpenAI routes:
tenant-scoped usage of what went through the gateway, sign-in through its key cache,
and the admin dashboard with the pool's worker status."""

from __future__ import annotations

import time

import httpx
from sqlalchemy.orm import Session, sessionmaker

from kvtoll.settings import Settings
from tests.proxy.helpers import ADMIN_TOKEN, MODEL, LiveServer, Tenants, build_app, settled_rows
from tests.proxy.scripted import ScriptedUpstream

USAGE = "/v1/organization/usage/completions"


def _usage(server: LiveServer, key: str) -> dict[str, int]:
    now = int(time.time())
    response = httpx.get(
        server.url + USAGE, headers={"Authorization": f"Bearer {key}"}, timeout=30,
        params={"start_time": now - 86_400, "end_time": now + 3600, "bucket_width": "1d"},
    )
    assert response.status_code == 200, response.text
    results = [r for bucket in response.json()["data"] for r in bucket["results"]]
    return {f: sum(r[f] for r in results) for f in ("num_model_requests", "input_tokens",
                                                   "output_tokens")}


def test_gateway_serves_dashboard_usage_api_and_admin_dashboard(
    settings: Settings, db: sessionmaker[Session], tenants: Tenants
) -> None:
    upstream = ScriptedUpstream("worker-a", num_words=4)
    with LiveServer(build_app(settings, db, upstreams=[upstream])) as server:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        for _ in range(2):
            answer = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30,
                                headers={"Authorization": f"Bearer {tenants.key_a}"})
            assert answer.status_code == 200
        rows = settled_rows(db, 2)
        sign_in = httpx.get(server.url + "/dashboard", timeout=30)
        assert sign_in.status_code == 200 and 'name="api_key"' in sign_in.text
        used_a, used_b = _usage(server, tenants.key_a), _usage(server, tenants.key_b)
        assert used_a == {
            "num_model_requests": 2,
            "input_tokens": sum(r.prompt_tokens for r in rows),
            "output_tokens": sum(r.completion_tokens for r in rows),
        }
        assert used_b == {"num_model_requests": 0, "input_tokens": 0, "output_tokens": 0}
        refused = httpx.get(server.url + USAGE, headers={"Authorization": "Bearer kvt_nope"})
        assert refused.status_code == 401
        with httpx.Client(base_url=server.url, timeout=30,
                          follow_redirects=True) as client:
            signed = client.post("/dashboard/login", data={"api_key": tenants.key_a})
            assert signed.status_code == 200 and "acme" in signed.text
            admin = client.post("/admin/dashboard/login", data={"admin_token": ADMIN_TOKEN})
            assert admin.status_code == 200
            assert "acme" in admin.text and "globex" in admin.text
            assert "worker-a" in admin.text  # the pool's worker status


def test_root_is_a_landing_page_and_docs_list_the_api(
    settings: Settings, db: sessionmaker[Session]
) -> None:
    upstream = ScriptedUpstream("worker-a", num_words=4)
    with LiveServer(build_app(settings, db, upstreams=[upstream])) as server:
        root = httpx.get(server.url + "/", timeout=30)
        assert root.status_code == 200 and root.headers["content-type"].startswith("text/html")
        assert root.headers["content-security-policy"].startswith("default-src 'self'")
        for href in ("/dashboard", "/admin/dashboard", "/docs", "/metrics"):
            assert f'href="{href}"' in root.text
            linked = httpx.get(server.url + href, timeout=30)
            assert linked.status_code in (200, 401), (href, linked.status_code)  # metrics: token
        docs = httpx.get(server.url + "/docs", timeout=30)
        assert docs.status_code == 200
        for route in ("/v1/chat/completions", "/v1/models", "/v1/invoices/preview", "/readyz"):
            assert f"<code>{route}</code>" in docs.text
