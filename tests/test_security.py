"""The trust boundaries, attacked as an insider on the network would, against a real
stack: real Redis, two real ``kvtoll worker`` processes (tiny model; worker 1 over
TLS with a certificate made here, worker 2 registered in Redis), and two real
``kvtoll serve`` processes:

* gateway ``G`` as in production: worker token, CA bundle for worker 1, Redis worker
  discovery on, metrics token, admin token and server secret;
* gateway ``D`` in dev mode, no server secret (the dev-mode secret file applies),
  Redis configured but discovery off, still on the *previous* worker token (a
  rotation half done: the workers accept both).

Each test is one attack from the issue and asserts it is refused. Started once for
the module; every wait polls for a condition, none asserts a duration.
"""

from __future__ import annotations

import http.server
import json
import os
import re
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import httpx
import pytest
import redis
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from billing.db import make_engine, session_factory
from billing.migrate import upgrade
from billing.models import ApiKey, Tenant
from engine.api.wire import announcement_body, announcement_key
from engine.kv.hashing import derive_tenant_salt
from tests.proxy.helpers import Tenants, free_port, ledger_count, seed, wait_until
from web.auth import TENANT_COOKIE
from web.tokens import TokenSigner

pytestmark = pytest.mark.redis

CURRENT = "security-test-worker-token-current"
PREVIOUS = "security-test-worker-token-previous"
STALE = "security-test-worker-token-rotated-out"
ADMIN_TOKEN = "security-test-admin-token-0123456789"
METRICS_TOKEN = "security-test-metrics-token-0123456"
OLD_DEV_SECRET = b"kvtoll-dev-secret"  # what dev mode signed with before
MODEL = "kvtoll-tiny"
PREFIX = "kvtoll:"  # the default prefix workers and gateways use
SECURITY_REDIS_DB = 13  # no other test uses it (_own_database)
SYSTEM = "You are the security test's assistant; answer briefly and politely. " * 3


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


class Evil:
    """An attacker's HTTP server that would happily take prompts and salts."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        evil = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _answer(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(length) if length else b""
                evil.seen.append(f"{self.command} {self.path} {body[:200]!r}")
                reply = json.dumps({"num_running": 0, "num_waiting": 0, "num_free_blocks": 9,
                                    "num_total_blocks": 9, "data": [{"id": MODEL}]}).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            do_GET = do_POST = _answer

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@dataclass
class Proc:
    proc: subprocess.Popen[bytes]
    log: Path

    def text(self) -> str:
        return self.log.read_text(errors="replace")


@dataclass
class Stack:
    tmp: Path
    redis_url: str
    ca: Path
    worker1: str  # https, static on both gateways
    worker2: str  # http, registered in Redis
    gateway: str  # G
    dev: str  # D
    g_db: sessionmaker[Session]
    d_db: sessionmaker[Session]
    g_tenants: Tenants
    d_tenants: Tenants
    g_env: dict[str, str]
    procs: dict[str, Proc] = field(default_factory=dict)


def _kvtoll(args: list[str], env: dict[str, str], log: Path) -> Proc:
    code = "from kvtoll.cli.main import main; main()"
    out = log.open("wb")
    proc = subprocess.Popen([sys.executable, "-c", code, *args], env=env, stdout=out,
                            stderr=subprocess.STDOUT)
    return Proc(proc, log)


def _wait_up(url: str, proc: Proc, headers: dict[str, str], verify: object = True) -> None:
    def up() -> bool:
        if proc.proc.poll() is not None:
            raise AssertionError(f"{url} exited {proc.proc.returncode}: {proc.text()[-3000:]}")
        try:
            response = httpx.get(f"{url}/healthz", headers=headers, verify=verify, timeout=2)  # type: ignore[arg-type]
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    wait_until(up, f"{url} to answer", 180)


def _certificate(tmp: Path) -> tuple[Path, Path]:
    cert, key = tmp / "worker1.pem", tmp / "worker1.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )
    return cert, key


def _database(path: Path) -> tuple[str, sessionmaker[Session], Tenants]:
    url = f"sqlite:///{path}"
    upgrade(url)
    factory = session_factory(make_engine(url))
    return url, factory, seed(factory, model=MODEL)


def _base_env(tmp: Path) -> dict[str, str]:
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTOLL_")}
    return {**env, "PYTHONPATH": str(root), "KVTOLL_LOG_LEVEL": "warning",
            "KVTOLL_DATA_DIR": str(tmp / "worker-data")}


def _start_workers(stack: Stack, env: dict[str, str], cert: Path, key: Path) -> None:
    worker_env = {**env, "KVTOLL_WORKER_TOKEN": CURRENT, "KVTOLL_WORKER_TOKEN_PREVIOUS": PREVIOUS}
    tiny = ["--model", MODEL, "--num-blocks", "96", "--max-model-len", "512"]
    port1, port2 = (int(u.rsplit(":", 1)[1]) for u in (stack.worker1, stack.worker2))
    stack.procs["worker1"] = _kvtoll(
        ["worker", *tiny, "--port", str(port1), "--tls-cert", str(cert), "--tls-key", str(key)],
        worker_env, stack.tmp / "worker1.log")
    stack.procs["worker2"] = _kvtoll(
        ["worker", *tiny, "--port", str(port2), "--redis-url", stack.redis_url,
         "--advertise-url", stack.worker2, "--kv-events", "http"],
        worker_env, stack.tmp / "worker2.log")


def _start_gateways(stack: Stack, env: dict[str, str], g_url: str, d_url: str) -> None:
    common = {**env, "KVTOLL_REDIS_URL": stack.redis_url, "KVTOLL_WORKER_TLS_CA": str(stack.ca)}
    stack.g_env = {**common, "KVTOLL_DATABASE_URL": g_url, "KVTOLL_ADMIN_TOKEN": ADMIN_TOKEN,
                   "KVTOLL_SECRET": "security-test-server-secret",
                   "KVTOLL_METRICS_TOKEN": METRICS_TOKEN, "KVTOLL_WORKER_TOKEN": CURRENT,
                   "KVTOLL_DATA_DIR": str(stack.tmp / "g-data")}
    d_env = {**common, "KVTOLL_DATABASE_URL": d_url, "KVTOLL_DEV_MODE": "1",
             "KVTOLL_WORKER_TOKEN": PREVIOUS, "KVTOLL_DATA_DIR": str(stack.tmp / "d-data")}
    serve = ["serve", "--no-semantic-cache", "--worker", stack.worker1]
    g_port, d_port = (int(u.rsplit(":", 1)[1]) for u in (stack.gateway, stack.dev))
    stack.procs["gateway"] = _kvtoll([*serve, "--port", str(g_port), "--worker-discovery"],
                                     stack.g_env, stack.tmp / "gateway.log")
    stack.procs["dev"] = _kvtoll([*serve, "--port", str(d_port)], d_env, stack.tmp / "dev.log")


def _own_database(redis_url: str) -> str:
    """The stack's Redis in a database of its own (emptied first): G discovers workers
    under the default prefix, so a worker another test registers there at the same
    time (the suite runs on two processes) must not join G's pool."""
    url = urlsplit(redis_url)
    own = urlunsplit(url._replace(path=f"/{SECURITY_REDIS_DB}"))
    redis.Redis.from_url(own).flushdb()
    return own


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("security")
    cert, key = _certificate(tmp)
    g_url, g_db, g_tenants = _database(tmp / "g.db")
    d_url, d_db, d_tenants = _database(tmp / "d.db")
    ports = [free_port() for _ in range(4)]
    stack = Stack(tmp, _own_database(redis_url), cert, f"https://127.0.0.1:{ports[0]}",
                  f"http://127.0.0.1:{ports[1]}", f"http://127.0.0.1:{ports[2]}",
                  f"http://127.0.0.1:{ports[3]}", g_db, d_db, g_tenants, d_tenants, {})
    env = _base_env(tmp)
    try:
        _start_workers(stack, env, cert, key)
        _wait_up(stack.worker1, stack.procs["worker1"], _bearer(CURRENT), verify=str(cert))
        _wait_up(stack.worker2, stack.procs["worker2"], _bearer(CURRENT))
        _start_gateways(stack, env, g_url, d_url)
        _wait_up(stack.gateway, stack.procs["gateway"], {})
        _wait_up(stack.dev, stack.procs["dev"], {})
        yield stack
    finally:
        for proc in stack.procs.values():
            proc.proc.terminate()
        for proc in stack.procs.values():
            try:
                proc.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.proc.kill()
                proc.proc.wait(timeout=30)


def _chat(base: str, key: str, user: str = "Name a colour.") -> httpx.Response:
    body = {"model": MODEL, "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]}
    return httpx.post(f"{base}/v1/chat/completions", json=body, headers=_bearer(key), timeout=120)


def _metrics(stack: Stack) -> str:
    return httpx.get(f"{stack.gateway}/metrics", headers=_bearer(METRICS_TOKEN), timeout=10).text


def _registered(stack: Stack, name: str) -> Callable[[], bool]:
    return lambda: f'kvtoll_router_worker_healthy{{worker="{name}"}} 1.0' in _metrics(stack)


# ------------------------------------------------------------------ 1. the registry
def test_redis_writers_cannot_add_a_worker(stack: Stack) -> None:
    """Keys written by hand (unsigned, wrong token, expired, a genuine record tampered
    or copied) add no worker to either gateway; neither sends them a single byte,
    while the genuinely registered worker 2 joins G (discovery on) but not D (off)."""
    evil = Evil()
    client = redis.Redis.from_url(stack.redis_url)
    written: list[str] = []
    try:
        wait_until(_registered(stack, stack.worker2), "worker 2's registration on G", 60)
        raw = client.get(announcement_key(PREFIX, stack.worker2))
        assert isinstance(raw, bytes)
        genuine = raw.decode()
        now = time.time()
        forged = {
            "evil-plain": json.dumps({"url": evil.url, "kv_events": "http"}),
            "evil-wrong": announcement_body("evil-wrong", evil.url, "http", None, now + 60,
                                            [STALE]),
            "evil-expired": announcement_body("evil-expired", evil.url, "http", None, now - 1,
                                              [CURRENT]),
            "evil-tampered": genuine.replace(stack.worker2, evil.url),
            "evil-copied": genuine,  # worker 2's record under another name
        }
        for name, body in forged.items():
            client.set(announcement_key(PREFIX, name), body, ex=120)
            written.append(name)
        marker = announcement_body("marker", stack.worker2, "http", None, time.time() + 60,
                                   [CURRENT])
        client.set(announcement_key(PREFIX, "marker"), marker, ex=60)  # written last
        written.append("marker")
        wait_until(_registered(stack, "marker"), "a discovery round after the forged keys", 60)
        for i in range(6):
            tenants = stack.g_tenants
            response = _chat(stack.gateway, tenants.key_a if i % 2 else tenants.key_b, f"q{i}")
            assert response.status_code == 200, response.text
            assert response.headers["x-kvtoll-worker"] in {stack.worker1, stack.worker2, "marker"}
        metrics = _metrics(stack)
        assert "evil" not in metrics and evil.url not in metrics
        # D has Redis but no --worker-discovery: its --worker list is the whole pool
        dev_metrics = httpx.get(f"{stack.dev}/metrics", timeout=10).text
        assert stack.worker2 not in dev_metrics and "marker" not in dev_metrics
        for i in range(2):
            response = _chat(stack.dev, stack.d_tenants.key_a, f"d{i}")  # on the previous token
            assert response.status_code == 200, response.text
            assert response.headers["x-kvtoll-worker"] == stack.worker1
        assert evil.seen == []
        gateway_log = stack.procs["gateway"].text()
        assert all(f"registration of worker '{n}'" in gateway_log for n in forged)
    finally:
        for name in written:
            client.delete(announcement_key(PREFIX, name))
        client.close()
        evil.close()


def _refusals(text: str) -> int:
    """The worker's WARNING lines for refused callers (any log format)."""
    return len(re.findall(r"WARNING (?:\S+ )?refused ", text))


def _settled_count(factory: sessionmaker[Session], gateway: str) -> int:
    """The ledger's row count once ``gateway``'s outbox holds nothing (earlier tests'
    rows drained). A quiet spell of the count did not tell: a gateway's first batch also
    starts its ledger writer process, which on a loaded CI machine took longer than the
    0.6 s this once waited for two equal readings."""
    def drained() -> bool:
        body = httpx.get(gateway + "/readyz", timeout=10).json()
        return body["outbox_depth"] == 0

    wait_until(drained, f"{gateway}'s outbox to drain", 60)
    return ledger_count(factory)


# ------------------------------------------------------------------ 2. the workers
@pytest.mark.parametrize("who", ["worker1", "worker2"])
def test_workers_refuse_callers_without_the_token(stack: Stack, who: str) -> None:
    """No token, a wrong one or a rotated-out one: 401 on every route with nothing
    said about why, one WARNING line each, nothing generated, nothing billed; the
    current and the previous token pass (a rotation without downtime)."""
    url = getattr(stack, who)
    verify: object = str(stack.ca) if url.startswith("https") else True
    log = stack.procs[who]
    before_lines = _refusals(log.text())
    billed = _settled_count(stack.g_db, stack.gateway), _settled_count(stack.d_db, stack.dev)
    salt = derive_tenant_salt(b"a guessed or leaked secret", stack.g_tenants.tenant_a).hex()
    probe = {"model": MODEL, "max_tokens": 2, "cache_salt": salt,
             "messages": [{"role": "system", "content": SYSTEM},
                          {"role": "user", "content": "Name a colour."}]}
    calls = [("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("GET", "/load"),
             ("GET", "/kv/events"), ("GET", "/v1/models"), ("GET", "/healthz")]
    refused = 0
    with httpx.Client(verify=verify, timeout=30) as http:  # type: ignore[arg-type]
        for headers in ({}, _bearer(STALE), _bearer(CURRENT + "x"), {"Authorization": CURRENT}):
            for method, path in calls:
                response = http.request(method, url + path, json=probe, headers=headers)
                assert response.status_code == 401, (headers, path)
                assert response.json()["error"]["message"] == "unauthorized"
                assert CURRENT not in response.text and "previous" not in response.text
                refused += 1
        for token in (CURRENT, PREVIOUS):
            assert http.get(url + "/load", headers=_bearer(token)).status_code == 200
    wait_until(lambda: _refusals(log.text()) == before_lines + refused,
               "one warning per refused request", 30)
    assert CURRENT not in log.text() and STALE not in log.text()
    assert (ledger_count(stack.g_db), ledger_count(stack.d_db)) == billed


@pytest.mark.parametrize("token", [STALE, ""])
def test_a_gateway_with_a_stale_or_no_token_refuses_to_start(stack: Stack, token: str) -> None:
    """Outside dev mode: no token is refused before any call; a rotated-out one is
    refused by the workers, which the gateway reports in one line (nothing served)."""
    env = {**stack.g_env, "KVTOLL_WORKER_TOKEN": token}
    code = "from kvtoll.cli.main import main; main()"
    result = subprocess.run(
        [sys.executable, "-c", code, "serve", "--no-semantic-cache", "--port", str(free_port()),
         "--worker", stack.worker1], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    expected = "refused the worker token" if token else "KVTOLL_WORKER_TOKEN is empty"
    assert result.stderr.startswith("error: ") and expected in result.stderr
    assert STALE not in result.stderr


# ------------------------------------------------------------------ 3. dev mode's secret
def test_dev_mode_sessions_cannot_be_forged_with_the_old_public_secret(stack: Stack) -> None:
    """On D (dev mode): a cookie signed with the old constant, for another tenant's
    key, reads nothing; a genuine sign-in still works."""
    with stack.d_db() as session:
        victim_key = session.scalars(
            select(ApiKey.id).join(Tenant).where(Tenant.name == "globex")).one()
    forger = TokenSigner(OLD_DEV_SECRET, "tenant-session", 3600)
    for claims in ({"tid": stack.d_tenants.tenant_b, "kid": victim_key}, {"sid": "guess"}):
        cookie = forger.issue(claims, time.time())
        response = httpx.get(f"{stack.dev}/v1/invoices", cookies={TENANT_COOKIE: cookie})
        assert response.status_code == 401
    with httpx.Client(base_url=stack.dev) as browser:
        browser.post("/dashboard/login", data={"api_key": stack.d_tenants.key_a})
        assert browser.get("/v1/invoices").status_code == 200
    secret_file = stack.tmp / "d-data" / "dev-secret"
    assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600


def test_dev_mode_salts_cannot_be_computed_without_the_secret_file(stack: Stack) -> None:
    """The tenant salt D sends is keyed by the data directory's random secret: the old
    public constant's salt for the same tenant finds none of its prefix cache, the
    secret file's does (so the probe can see a hit)."""
    tenant = stack.d_tenants.tenant_a
    user = "Which planet is the largest?"
    assert _chat(stack.dev, stack.d_tenants.key_a, user).status_code == 200  # warms worker 1
    secret = (stack.tmp / "d-data" / "dev-secret").read_text().strip().encode()

    def cached_with(salt_secret: bytes) -> int:
        body = {"model": MODEL, "max_tokens": 1, "temperature": 0,
                "cache_salt": derive_tenant_salt(salt_secret, tenant).hex(),
                "messages": [{"role": "system", "content": SYSTEM},
                             {"role": "user", "content": user}]}
        response = httpx.post(f"{stack.worker1}/v1/chat/completions", json=body,
                              headers=_bearer(CURRENT), verify=str(stack.ca), timeout=60)
        assert response.status_code == 200, response.text
        return int(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

    assert cached_with(OLD_DEV_SECRET) == 0
    assert cached_with(secret) > 0


# ------------------------------------------------------------------ 4. the smaller ones
def test_logout_and_revocation_end_a_cookie_session(stack: Stack) -> None:
    key = stack.g_tenants.key_a
    with httpx.Client(base_url=stack.gateway) as browser:
        login = browser.post("/dashboard/login", data={"api_key": key})
        cookie_header = login.headers["set-cookie"].lower()
        assert login.status_code == 303 and "samesite=lax" in cookie_header
        assert "httponly" in cookie_header
        stolen = browser.cookies[TENANT_COOKIE]
        assert browser.get("/v1/invoices").status_code == 200
        browser.post("/dashboard/logout")
    replay = httpx.get(f"{stack.gateway}/v1/invoices", cookies={TENANT_COOKIE: stolen})
    assert replay.status_code == 401


def test_metrics_need_a_token_outside_dev_mode(stack: Stack) -> None:
    assert httpx.get(f"{stack.gateway}/metrics").status_code == 401
    assert httpx.get(f"{stack.gateway}/metrics", headers=_bearer("guess")).status_code == 401
    for token in (METRICS_TOKEN, ADMIN_TOKEN):
        response = httpx.get(f"{stack.gateway}/metrics", headers=_bearer(token))
        assert response.status_code == 200 and "kvtoll_outbox_depth" in response.text


def _cli(stack: Stack, *args: str) -> subprocess.CompletedProcess[str]:
    code = "from kvtoll.cli.main import main; main()"
    return subprocess.run([sys.executable, "-c", code, *args], env=stack.g_env,
                          capture_output=True, text=True, timeout=120)


def test_tenant_names_clash_ignoring_case(stack: Stack) -> None:
    result = _cli(stack, "tenant", "create", "ACME")  # "acme" exists
    assert result.returncode == 2 and result.stderr.startswith("error: ")
    assert "already exists" in result.stderr
    with stack.g_db() as session:
        names = session.scalars(select(Tenant.name)).all()
    assert sorted(names) == ["acme", "globex"]


def test_a_revoked_key_stops_working_on_every_gateway_within_the_stated_bound(
    stack: Stack,
) -> None:
    """The help states the bound; the key then fails on G (the bound is the key cache's
    lifetime, tested with a clock in tests/proxy/test_auth.py), and its dashboard
    session ends at once."""
    from billing.keys import REVOCATION_BOUND_S

    help_text = " ".join(_cli(stack, "key", "revoke", "--help").stdout.split())
    assert f"within {REVOCATION_BOUND_S} s" in help_text and "immediately" not in help_text
    key = stack.g_tenants.key_b
    assert _chat(stack.gateway, key).status_code == 200
    with httpx.Client(base_url=stack.gateway) as browser:
        browser.post("/dashboard/login", data={"api_key": key})
        assert browser.get("/v1/invoices").status_code == 200
        with stack.g_db() as session:
            key_id = session.scalars(
                select(ApiKey.id).join(Tenant).where(Tenant.name == "globex")).one()
        result = _cli(stack, "key", "revoke", key_id)
        assert result.returncode == 0, result.stderr
        assert browser.get("/v1/invoices").status_code == 401  # the session: at once
    wait_until(lambda: _chat(stack.gateway, key).status_code == 401, "the revoked key refused",
               10 * REVOCATION_BOUND_S)
