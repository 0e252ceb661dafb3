"""Every bad input from the issue → 4xx in OpenAI's error shape, no ledger row, and the
server keeps serving."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from sqlalchemy.orm import Session, sessionmaker

from kvtoll.settings import Settings
from proxy.config import AdmissionLimits, ProxyConfig
from tests.proxy.helpers import MODEL, LiveServer, Tenants, build_app, settled_rows
from tests.proxy.scripted import ScriptedUpstream

CHAT = "/v1/chat/completions"
GOOD = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
MAX_BODY = 20_000


def _chat(**fields: object) -> dict[str, object]:
    return {**GOOD, **fields}


BAD_JSON_BODIES: list[tuple[str, bytes, int, str | None]] = [
    ("malformed json", b'{"model": "test-model", "messages": [', 400, "invalid_json"),
    ("not an object", b"[1, 2, 3]", 400, "invalid_json"),
    ("empty body", b"", 400, "invalid_json"),
    ("invalid utf-8", b'{"model": "test-model\xff\xfe", "messages": []}', 400, "invalid_encoding"),
    (
        "temperature NaN",
        b'{"model": "test-model", "messages": [{"role": "user", "content": "x"}],'
        b' "temperature": NaN}',
        400,
        "invalid_json",
    ),
    ("oversized body", b'{"model": "' + b"x" * (MAX_BODY + 10) + b'"}', 413, "request_too_large"),
]

BAD_FIELDS: list[tuple[str, dict[str, object], int, str | None]] = [
    ("wrong type messages", _chat(messages="hello"), 400, "messages"),
    ("wrong type max_tokens", _chat(max_tokens="10"), 400, "max_tokens"),
    ("unknown model", _chat(model="gpt-17"), 404, "model"),
    ("empty messages", _chat(messages=[]), 400, "messages"),
    ("negative max_tokens", _chat(max_tokens=-5), 400, "max_tokens"),
    ("zero max_tokens", _chat(max_tokens=0), 400, "max_tokens"),
    ("huge max_tokens", _chat(max_tokens=10**9), 400, "max_tokens"),
    ("n over the cap", _chat(n=9), 400, "n"),
    ("temperature out of range", _chat(temperature=7.5), 400, "temperature"),
    ("upstream url field", _chat(base_url="http://evil.example/v1"), 400, "base_url"),
    ("upstream worker field", _chat(worker="http://10.0.0.1:8000"), 400, "worker"),
    ("unknown field", _chat(frobnicate=True), 400, "frobnicate"),
    ("bad role", _chat(messages=[{"role": "wizard", "content": "x"}]), 400, None),
    ("missing content", _chat(messages=[{"role": "user"}]), 400, None),
]


@pytest.fixture
def server(settings: Settings, db: sessionmaker[Session], tenants: Tenants) -> Iterator[LiveServer]:
    config = ProxyConfig(limits=AdmissionLimits(max_body_bytes=MAX_BODY, max_n=8))
    app = build_app(settings, db, upstreams=[ScriptedUpstream()], config=config)
    with LiveServer(app) as live:
        yield live


@pytest.fixture
def http(server: LiveServer, tenants: Tenants) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {tenants.key_a}"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=30) as client:
        yield client


def _assert_openai_error(response: httpx.Response, status: int) -> dict[str, object]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    return dict(error)


@pytest.mark.parametrize(("case", "body", "status", "code"), BAD_JSON_BODIES,
                         ids=[c[0] for c in BAD_JSON_BODIES])
def test_bad_bodies(http: httpx.Client, db: sessionmaker[Session], case: str, body: bytes,
                    status: int, code: str | None) -> None:
    response = http.post(CHAT, content=body, headers={"content-type": "application/json"})
    assert _assert_openai_error(response, status)["code"] == code
    assert http.post(CHAT, json=GOOD).status_code == 200
    settled_rows(db, 1)


@pytest.mark.parametrize(("case", "body", "status", "param"), BAD_FIELDS,
                         ids=[c[0] for c in BAD_FIELDS])
def test_bad_fields(http: httpx.Client, db: sessionmaker[Session], case: str,
                    body: dict[str, object], status: int, param: str | None) -> None:
    error = _assert_openai_error(http.post(CHAT, json=body), status)
    if param is not None:
        assert error["param"] == param
    assert http.post(CHAT, json=GOOD).status_code == 200
    settled_rows(db, 1)


def test_bad_completion_prompts(http: httpx.Client) -> None:
    prompts: list[object] = ["", [], [-1], [[]], {"text": "x"}, None]
    for prompt in prompts:
        body = {"model": MODEL, "prompt": prompt}
        _assert_openai_error(http.post("/v1/completions", json=body), 400)
    assert http.post("/v1/completions", json={"model": MODEL, "prompt": "ok"}).status_code == 200


def test_unknown_route_and_method(http: httpx.Client) -> None:
    _assert_openai_error(http.get("/v1/nothing-here"), 404)
    _assert_openai_error(http.get(CHAT), 405)


def test_client_salt_is_ignored(server: LiveServer, http: httpx.Client, tenants: Tenants) -> None:
    """A client-sent ``cache_salt`` never reaches the upstream; the server derives its own."""
    from engine.kv.hashing import derive_tenant_salt

    app: Any = server.server.config.app
    upstream: ScriptedUpstream = app.state.kvtoll.pool.upstreams[0]
    response = http.post(CHAT, json=_chat(cache_salt="00" * 16))
    assert response.status_code == 200
    sent = upstream.seen[-1]
    assert "cache_salt" not in sent.body
    assert sent.salt == derive_tenant_salt(b"test-server-secret", tenants.tenant_a)
    assert sent.salt != derive_tenant_salt(b"test-server-secret", tenants.tenant_b)


def test_the_upstream_gets_the_request_parsed_once_as_admitted(
    server: LiveServer, http: httpx.Client
) -> None:
    """The body is parsed once, at intake: the upstream receives that typed request as
    admitted (client salt dropped, ``max_completion_tokens`` as ``max_tokens``), the
    same request as the body it is sent, so no upstream has to validate it again."""
    from kvtoll.openai.protocol import parse_request

    app: Any = server.server.config.app
    upstream: ScriptedUpstream = app.state.kvtoll.pool.upstreams[0]
    response = http.post(CHAT, json=_chat(cache_salt="00" * 16, max_completion_tokens=7))
    assert response.status_code == 200
    sent = upstream.seen[-1]
    assert sent.parsed is not None and sent.parsed == parse_request("chat", sent.body)
    assert sent.parsed.cache_salt is None and sent.parsed.max_completion_tokens is None
    assert sent.parsed.max_tokens == sent.body["max_tokens"] == 7
