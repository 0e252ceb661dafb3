"""Sign-in, session cookies and the admin token (SQLite; the logic is database-agnostic)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from billing.accounts import revoke_key
from kvtoll.settings import Settings, load_settings
from tests.web.webseed import ADMIN_TOKEN, add_tenant
from web.app import create_web_app
from web.auth import ADMIN_COOKIE, TENANT_COOKIE
from web.tokens import TokenSigner


def test_tokens_reject_tampering_expiry_and_other_purposes() -> None:
    signer = TokenSigner(b"s" * 32, "tenant-session", ttl_s=60)
    token = signer.issue({"tid": 1, "kid": "key_x"}, now=1000)
    assert signer.verify(token, now=1059)["tid"] == 1  # type: ignore[index]
    assert signer.verify(token, now=1060) is None
    payload, signature = token.split(".")
    forged = TokenSigner(b"s" * 32, "tenant-session", 60).issue({"tid": 2}, now=1000)
    assert signer.verify(forged.split(".")[0] + "." + signature, now=1001) is None
    # Change the signature's last character (to one it is not: a fixed "AA" suffix equalled
    # the real signature one time in 4096, and the test then failed on a genuine token).
    tampered = signature[:-1] + ("A" if signature[-1] != "A" else "B")
    assert signer.verify(payload + "." + tampered, now=1001) is None
    assert TokenSigner(b"s" * 32, "admin-session", 60).verify(token, now=1001) is None
    assert TokenSigner(b"t" * 32, "tenant-session", 60).verify(token, now=1001) is None
    for junk in ("", "a.b.c", "nodot", "x" * 5000):
        assert signer.verify(junk, now=1001) is None


def test_dashboard_sign_in_sets_a_safe_cookie_that_dies_with_the_key(
    sqlite_web_factory: sessionmaker[Session], settings: Settings
) -> None:
    seed = add_tenant(sqlite_web_factory, "alpha", num_keys=1)
    client = TestClient(create_web_app(settings, sqlite_web_factory))
    assert 'name="api_key"' in client.get("/dashboard").text
    refused = client.post("/dashboard/login", data={"api_key": "kvt_wrong"})
    assert refused.status_code == 401 and TENANT_COOKIE not in refused.cookies
    response = client.post("/dashboard/login", data={"api_key": seed.first_key},
                           follow_redirects=False)
    assert response.status_code == 303
    header = response.headers["set-cookie"]
    assert "HttpOnly" in header and "SameSite=lax" in header and "Max-Age=" in header
    assert "Secure" not in header  # plain http here; see the https test below
    cookie = response.cookies[TENANT_COOKIE]
    assert seed.first_key not in cookie and seed.first_key[4:20] not in cookie
    page = client.get("/dashboard")
    assert page.status_code == 200 and "alpha" in page.text
    assert "script-src 'self'" in page.headers["content-security-policy"]
    with sqlite_web_factory.begin() as session:
        revoke_key(session, next(iter(seed.keys)))
    assert 'name="api_key"' in client.get("/dashboard").text
    assert client.get("/v1/invoices").status_code == 401


def test_cookies_are_secure_over_https(
    sqlite_web_factory: sessionmaker[Session], settings: Settings
) -> None:
    seed = add_tenant(sqlite_web_factory, "alpha", num_keys=1)
    client = TestClient(create_web_app(settings, sqlite_web_factory), base_url="https://testserver")
    response = client.post("/dashboard/login", data={"api_key": seed.first_key},
                           follow_redirects=False)
    header = response.headers["set-cookie"]
    assert "Secure" in header and "HttpOnly" in header and "SameSite=lax" in header
    admin = client.post("/admin/dashboard/login", data={"admin_token": ADMIN_TOKEN},
                        follow_redirects=False)
    assert "Secure" in admin.headers["set-cookie"]


def test_logout_ends_the_session_for_a_copied_cookie_too(
    sqlite_web_factory: sessionmaker[Session], settings: Settings
) -> None:
    seed = add_tenant(sqlite_web_factory, "alpha", num_keys=1)
    client = TestClient(create_web_app(settings, sqlite_web_factory))
    client.post("/dashboard/login", data={"api_key": seed.first_key})
    stolen = client.cookies[TENANT_COOKIE]
    assert client.get("/v1/invoices").status_code == 200
    client.post("/dashboard/logout")
    thief = TestClient(create_web_app(settings, sqlite_web_factory))
    thief.cookies.set(TENANT_COOKIE, stolen)
    assert thief.get("/v1/invoices").status_code == 401
    assert 'name="api_key"' in thief.get("/dashboard").text
    # the operator's session likewise
    client.post("/admin/dashboard/login", data={"admin_token": ADMIN_TOKEN})
    admin_cookie = client.cookies[ADMIN_COOKIE]
    assert client.get("/admin/v1/invoices").status_code == 200
    client.post("/admin/dashboard/logout")
    thief.cookies.set(ADMIN_COOKIE, admin_cookie, path="/admin")
    assert thief.get("/admin/v1/invoices").status_code == 401


def test_a_signed_cookie_without_a_live_session_is_refused(
    sqlite_web_factory: sessionmaker[Session], settings: Settings
) -> None:
    """A cookie correctly signed with the server secret but naming no session (or the
    old claims: tenant and key ids) gets nothing."""
    seed = add_tenant(sqlite_web_factory, "alpha", num_keys=1)
    client = TestClient(create_web_app(settings, sqlite_web_factory))
    signer = TokenSigner(settings.server_secret(), "tenant-session", 3600)
    for claims in ({"tid": 1, "kid": next(iter(seed.keys))}, {"sid": "made-up"}):
        client.cookies.set(TENANT_COOKIE, signer.issue(claims, time.time()))
        assert client.get("/v1/invoices").status_code == 401


def test_cross_site_login_is_refused(
    sqlite_web_factory: sessionmaker[Session], settings: Settings
) -> None:
    seed = add_tenant(sqlite_web_factory, "alpha", num_keys=1)
    client = TestClient(create_web_app(settings, sqlite_web_factory))
    response = client.post("/dashboard/login", data={"api_key": seed.first_key},
                           headers={"Origin": "https://evil.example"}, follow_redirects=False)
    assert response.status_code == 403 and TENANT_COOKIE not in response.cookies


def test_bad_date_range_is_explained(
    sqlite_web_factory: sessionmaker[Session], settings: Settings
) -> None:
    seed = add_tenant(sqlite_web_factory, "alpha", num_keys=1)
    client = TestClient(create_web_app(settings, sqlite_web_factory))
    client.post("/dashboard/login", data={"api_key": seed.first_key})
    for query, message in (("start=2026-02-01&end=2026-01-01", "before the start"),
                           ("start=yesterday", "look like"),
                           ("start=9999-12-30&end=9999-12-31", "between")):
        page = client.get(f"/dashboard?{query}")
        assert page.status_code == 400 and message in page.text


def test_admin_token_sign_in_and_bearer(
    sqlite_web_factory: sessionmaker[Session], settings: Settings
) -> None:
    seed = add_tenant(sqlite_web_factory, "alpha", num_keys=1)
    client = TestClient(create_web_app(settings, sqlite_web_factory))
    api = "/admin/v1/invoices"
    assert client.get(api).status_code == 401
    for wrong in (seed.first_key, ADMIN_TOKEN[:-1]):
        assert client.get(api, headers={"Authorization": f"Bearer {wrong}"}).status_code == 401
    assert client.get(api, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}).status_code == 200
    assert client.post("/admin/dashboard/login", data={"admin_token": "nope"}).status_code == 401
    ok = client.post("/admin/dashboard/login", data={"admin_token": ADMIN_TOKEN},
                     follow_redirects=False)
    assert ok.status_code == 303 and "Path=/admin" in ok.headers["set-cookie"]
    assert ADMIN_TOKEN not in ok.cookies[ADMIN_COOKIE]
    assert client.get(api).status_code == 200
    assert "alpha" in client.get("/admin/dashboard").text
    # A tenant session is not an admin session.
    tenant = TestClient(create_web_app(settings, sqlite_web_factory))
    tenant.post("/dashboard/login", data={"api_key": seed.first_key})
    tenant.cookies.set(ADMIN_COOKIE, tenant.cookies[TENANT_COOKIE], path="/admin")
    assert tenant.get(api).status_code == 401


@pytest.mark.parametrize("token", ["", "admin", "short-token"])
def test_admin_refuses_to_work_with_a_weak_token(
    sqlite_web_factory: sessionmaker[Session], token: str
) -> None:
    weak = load_settings(admin_token=token, secret="x", dev_mode=False)
    client = TestClient(create_web_app(weak, sqlite_web_factory))
    response = client.get("/admin/v1/invoices", headers={"Authorization": f"Bearer {token}"})
    assert response.status_code == 503
    assert "KVTOLL_ADMIN_TOKEN" in response.json()["error"]["message"]
    assert client.post("/admin/dashboard/login", data={"admin_token": token}).status_code == 503
    page = client.get("/admin/dashboard")
    assert page.status_code == 503 and "KVTOLL_ADMIN_TOKEN" in page.text


def test_dev_mode_accepts_a_weak_token_but_not_none(
    sqlite_web_factory: sessionmaker[Session], tmp_path: Path
) -> None:
    dev = {"dev_mode": True, "data_dir": str(tmp_path)}
    weak = TestClient(create_web_app(load_settings(admin_token="admin", **dev),
                                     sqlite_web_factory))
    for token, status in (("admin", 200), ("x", 401)):
        headers = {"Authorization": f"Bearer {token}"}
        assert weak.get("/admin/v1/invoices", headers=headers).status_code == status
    empty = TestClient(create_web_app(load_settings(admin_token="", **dev),
                                      sqlite_web_factory))
    response = empty.get("/admin/v1/invoices", headers={"Authorization": "Bearer "})
    assert response.status_code == 503 and "empty" in response.json()["error"]["message"]
    assert empty.get("/admin/dashboard").status_code == 503
