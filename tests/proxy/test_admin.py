"""Admin API: admin-token guard (constant-time compare), tenants, keys, prices, and
billing errors mapped to 4xx in OpenAI's shape."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from sqlalchemy.orm import Session, sessionmaker

from kvtoll.settings import Settings, load_settings
from tests.proxy.helpers import ADMIN_TOKEN, MODEL, LiveServer, build_app
from tests.proxy.scripted import ScriptedUpstream


@pytest.fixture
def admin(settings: Settings, db: sessionmaker[Session]) -> Iterator[httpx.Client]:
    with LiveServer(build_app(settings, db, upstreams=[ScriptedUpstream()])) as server, \
            httpx.Client(base_url=server.url,
                         headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as client:
        yield client


def test_admin_token_required(admin: httpx.Client) -> None:
    for headers in ({"Authorization": ""}, {"Authorization": "Bearer wrong-token"},
                    {"Authorization": ADMIN_TOKEN}):
        response = admin.get("/admin/tenants", headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_admin_token"


def test_tenant_key_price_lifecycle(admin: httpx.Client) -> None:
    assert admin.post("/admin/tenants", json={"name": "acme"}).status_code == 201
    assert [t["name"] for t in admin.get("/admin/tenants").json()["data"]] == ["acme"]
    created = admin.post("/admin/tenants/acme/keys",
                         json={"name": "ci", "requests_per_minute": 5})
    assert created.status_code == 201
    key = created.json()
    assert key["key"].startswith("kvt_") and key["requests_per_minute"] == 5
    listed = admin.get("/admin/tenants/acme/keys").json()["data"]
    assert [k["key_id"] for k in listed] == [key["key_id"]]
    assert "key" not in listed[0]  # the plaintext is shown once
    price = {"model": MODEL, "input": "1.25", "cached_input": "0.5", "output": "3",
             "semantic_fraction": "0.1"}
    set_price = admin.post("/admin/prices", json=price)
    assert set_price.status_code == 201
    assert set_price.json()["input"] == "1.25"
    assert [p["model"] for p in admin.get("/admin/prices").json()["data"]] == [MODEL]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
    headers = {"Authorization": f"Bearer {key['key']}"}
    assert admin.post("/v1/chat/completions", json=chat, headers=headers).status_code == 200
    revoked = admin.post(f"/admin/keys/{key['key_id']}/revoke")
    assert revoked.status_code == 200 and revoked.json()["revoked_at"]


@pytest.mark.parametrize(
    ("method", "path", "body", "status"),
    [
        ("post", "/admin/tenants", {"name": "bad name!"}, 400),
        ("post", "/admin/tenants", {"name": 7}, 400),
        ("post", "/admin/tenants", {"name": "x", "extra": 1}, 400),
        ("get", "/admin/tenants/nobody/keys", None, 404),
        ("post", "/admin/tenants/nobody/keys", {}, 404),
        ("post", "/admin/keys/key_nope/revoke", None, 400),
        ("post", "/admin/keys/key_AAAAAAAAAAAAAAAAAAAA/revoke", None, 404),
        ("post", "/admin/prices", {"model": "m", "input": "-1", "cached_input": "0",
                                   "output": "0", "semantic_fraction": "0"}, 400),
        ("post", "/admin/prices", {"model": "m", "input": 1.5, "cached_input": "0",
                                   "output": "0", "semantic_fraction": "0"}, 400),
        ("post", "/admin/prices", {"model": "m", "input": "1", "cached_input": "2",
                                   "output": "0", "semantic_fraction": "0"}, 400),
    ],
)
def test_admin_bad_input(admin: httpx.Client, method: str, path: str,
                         body: dict[str, object] | None, status: int) -> None:
    response = admin.request(method, path, json=body)
    assert response.status_code == status, response.text
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert admin.get("/admin/tenants").json()["data"] == []


def test_duplicate_tenant_is_409(admin: httpx.Client) -> None:
    assert admin.post("/admin/tenants", json={"name": "acme"}).status_code == 201
    assert admin.post("/admin/tenants", json={"name": "acme"}).status_code == 409


@pytest.mark.parametrize("token", ["", "admin", "short-token"])
def test_refuses_weak_admin_token_outside_dev_mode(
    settings: Settings, db: sessionmaker[Session], token: str
) -> None:
    weak = settings.model_copy(update={"admin_token": load_settings(admin_token=token).admin_token})
    with pytest.raises(ValueError, match="KVTOLL_ADMIN_TOKEN"):
        build_app(weak, db, upstreams=[ScriptedUpstream()])
    dev = weak.model_copy(update={"dev_mode": True})
    assert build_app(dev, db, upstreams=[ScriptedUpstream()]) is not None


def test_admin_api_without_a_token_answers_503_like_the_web_admin(
    settings: Settings, db: sessionmaker[Session]
) -> None:
    """Dev mode starts without an admin token, and accepts a weak one."""
    for token, status in (("", 503), ("admin", 200)):
        update = {"dev_mode": True, "admin_token": load_settings(admin_token=token).admin_token}
        dev = settings.model_copy(update=update)
        with LiveServer(build_app(dev, db, upstreams=[ScriptedUpstream()])) as server:
            headers = {"Authorization": f"Bearer {token or 'x'}"}
            response = httpx.get(server.url + "/admin/tenants", headers=headers)
        assert response.status_code == status, response.text
        if status == 503:
            error = response.json()["error"]
            assert error["code"] == "admin_disabled" and "KVTOLL_ADMIN_TOKEN" in error["message"]


def test_tenant_error_bound_policy(admin: httpx.Client) -> None:
    assert admin.post("/admin/tenants", json={"name": "acme"}).status_code == 201
    assert admin.get("/admin/tenants/acme/policy").json()["semantic_max_error_rate"] == 0.02
    changed = admin.patch("/admin/tenants/acme/policy", json={"semantic_max_error_rate": 0.05})
    assert changed.status_code == 200, changed.text
    assert changed.json()["semantic_max_error_rate"] == 0.05
    for body, status in (({"semantic_max_error_rate": 0}, 400),
                         ({"semantic_max_error_rate": 1}, 400),
                         ({"semantic_max_error_rate": 1.5}, 400),
                         ({"semantic_max_error_rate": "0.1"}, 400),
                         ({"semantic_max_error_rate": 0.1, "x": 1}, 400), ({}, 400)):
        response = admin.patch("/admin/tenants/acme/policy", json=body)
        assert response.status_code == status, (body, response.text)
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    missing = admin.patch("/admin/tenants/nobody/policy", json={"semantic_max_error_rate": 0.1})
    assert missing.status_code == 404
    assert set(missing.json()["error"]) == {"message", "type", "param", "code"}
    assert admin.get("/admin/tenants/nobody/policy").status_code == 404
    assert admin.get("/admin/tenants/acme/policy").json()["semantic_max_error_rate"] == 0.05
    assert [t["name"] for t in admin.get("/admin/tenants").json()["data"]] == ["acme"]
