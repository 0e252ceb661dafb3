"""The completion endpoints' raw ASGI routes (proxy.http.completions): same answers at
the root and for an app under a root_path, errors in
OpenAI's shape, a body sent in several chunks, a client gone before its body, an
unexpected failure as a 500 object, and the paths documented in /openapi.json."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker
from starlette.middleware.gzip import GZipMiddleware

from kvtoll.settings import Settings
from proxy.http.completions import CompletionRoute, GatewayApp
from tests.proxy.helpers import MODEL, Tenants, build_app, settled_rows
from tests.proxy.scripted import ScriptedUpstream

CHAT = "/v1/chat/completions"
GOOD = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def _scope(path: str, key: str | None, body: bytes, root_path: str = "") -> dict[str, Any]:
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
    if key is not None:
        headers.append((b"authorization", f"Bearer {key}".encode()))
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1", "method": "POST", "scheme": "http",
            "path": root_path + path, "raw_path": (root_path + path).encode(),
            "query_string": b"", "root_path": root_path, "headers": headers,
            "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 50000)}


async def _call(app: FastAPI, scope: dict[str, Any],
                chunks: list[bytes]) -> tuple[int, dict[str, str], bytes]:
    """Run one request through ``app``; ``chunks`` are the body messages (an empty list:
    the client disconnects instead of sending a body)."""
    messages: list[dict[str, Any]] = [
        {"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
        for i, c in enumerate(chunks)
    ] or [{"type": "http.disconnect"}]
    sent: list[dict[str, Any]] = []
    done = asyncio.Event()

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop(0)
        await done.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body"):
            done.set()

    await app(scope, receive, send)
    if not sent:
        return 0, {}, b""
    headers = {k.decode(): v.decode() for k, v in sent[0]["headers"]}
    return sent[0]["status"], headers, b"".join(m.get("body", b"") for m in sent[1:])


@pytest.fixture
def app(settings: Settings, db: sessionmaker[Session], tenants: Tenants) -> FastAPI:
    return build_app(settings, db, upstreams=[ScriptedUpstream(num_words=3)])


@pytest.mark.parametrize("root_path", ["", "/gateway"])
def test_same_answers_fast_and_through_the_router(
    app: FastAPI, tenants: Tenants, db: sessionmaker[Session], root_path: str
) -> None:
    """Under a root_path the router strips it: same handler, same answers."""
    body = json.dumps(GOOD).encode()

    async def run() -> list[tuple[int, dict[str, str], bytes]]:
        return [
            await _call(app, _scope(CHAT, tenants.key_a, body, root_path), [body]),
            await _call(app, _scope(CHAT, None, body, root_path), [body]),
            await _call(app, _scope(CHAT, tenants.key_a, b"{", root_path), [b"{"]),
        ]

    with TestClient(app):  # lifespan: outbox drainer running
        (ok, ok_headers, ok_body), (no_key, _, no_key_body), (bad, _, bad_body) = (
            asyncio.run(run()))
    assert ok == 200
    assert ok_headers["content-type"] == "application/json"
    assert int(ok_headers["content-length"]) == len(ok_body)
    assert ok_headers["x-kvtoll-cache"] == "miss"
    assert ok_headers["x-kvtoll-worker"] == "scripted-0"
    answer = json.loads(ok_body)
    assert answer["choices"][0]["message"]["content"] == "word0 word1 word2 "
    request_id = ok_headers["x-kvtoll-request-id"]
    assert answer["id"] == "chatcmpl-" + request_id.replace("-", "")
    assert answer["usage"]["completion_tokens"] == 3
    assert (no_key, json.loads(no_key_body)["error"]["code"]) == (401, "invalid_api_key")
    assert (bad, json.loads(bad_body)["error"]["code"]) == (400, "invalid_json")
    rows = settled_rows(db, 1)
    assert rows[0].request_id == ok_headers["x-kvtoll-request-id"]


def test_body_in_several_chunks_and_size_cap(app: FastAPI, tenants: Tenants) -> None:
    body = json.dumps(GOOD).encode()
    pieces = [body[:7], body[7:20], body[20:]]
    huge = b"x" * 2_000_000

    async def run() -> list[tuple[int, dict[str, str], bytes]]:
        chunked = _scope(CHAT, tenants.key_a, body)
        chunked["headers"] = [h for h in chunked["headers"] if h[0] != b"content-length"]
        undeclared_huge = _scope(CHAT, tenants.key_a, b"")
        undeclared_huge["headers"] = [h for h in undeclared_huge["headers"]
                                      if h[0] != b"content-length"]
        bad_length = _scope(CHAT, tenants.key_a, body)
        bad_length["headers"] = [(b"content-length", b"12x"), *bad_length["headers"][:1],
                                 (b"authorization", f"Bearer {tenants.key_a}".encode())]
        return [
            await _call(app, chunked, pieces),
            await _call(app, _scope(CHAT, tenants.key_a, huge), [huge]),
            await _call(app, undeclared_huge, [huge[:600_000], huge[600_000:]]),
            await _call(app, bad_length, [body]),
        ]

    with TestClient(app):
        results = asyncio.run(run())
    assert results[0][0] == 200, results[0]
    assert [(r[0], json.loads(r[2])["error"]["code"]) for r in results[1:]] == [
        (413, "request_too_large"), (413, "request_too_large"), (400, "invalid_header")]


def test_client_gone_before_its_body(app: FastAPI, tenants: Tenants,
                                     db: sessionmaker[Session]) -> None:
    """Nothing to answer and nothing admitted: no response, no ledger row."""
    with TestClient(app):
        status, _, _ = asyncio.run(_call(app, _scope(CHAT, tenants.key_a, b"{}"), []))
        assert status == 0
    assert settled_rows(db, 0) == []


def test_unexpected_failure_is_a_500_error_object(
    settings: Settings, db: sessionmaker[Session], tenants: Tenants
) -> None:
    class Broken(ScriptedUpstream):
        def stream(self, request: Any) -> Any:
            raise KeyError("a bug")

    app = build_app(settings, db, upstreams=[Broken()])
    body = json.dumps(GOOD).encode()
    with TestClient(app):
        status, _, raw = asyncio.run(_call(app, _scope(CHAT, tenants.key_a, body), [body]))
    assert status == 500
    assert json.loads(raw)["error"]["code"] == "internal_error"


def test_openapi_documents_the_completion_paths(app: FastAPI) -> None:
    schema = TestClient(app).get("/openapi.json").json()
    for path, model in [(CHAT, "ChatCompletionRequest"), ("/v1/completions",
                                                          "CompletionRequest")]:
        body = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        assert body["schema"] == {"$ref": f"#/components/schemas/{model}"}
        fields = schema["components"]["schemas"][model]["properties"]
        assert "model" in fields and "stream" in fields
    messages = schema["components"]["schemas"]["ChatCompletionRequest"]["properties"]["messages"]
    assert messages["items"]["$ref"].removeprefix("#/components/schemas/") in (
        schema["components"]["schemas"])
    assert "/v1/models" in schema["paths"]  # FastAPI's own routes are still there


def test_app_middleware_sees_the_completion_routes(
    settings: Settings, db: sessionmaker[Session], tenants: Tenants
) -> None:
    """The completion paths are mounted once, in the app: middleware added to the app
    wraps them like every other route (no dispatch around it)."""
    seen: list[str] = []

    class Tag:
        def __init__(self, app: Any) -> None:
            self.app = app

        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            seen.append(scope.get("path", ""))

            async def tagged(message: Any) -> None:
                if message["type"] == "http.response.start":
                    message["headers"] = [*message["headers"], (b"x-tag", b"1")]
                await send(message)

            await self.app(scope, receive, tagged)

    app = build_app(settings, db, upstreams=[ScriptedUpstream(num_words=3)])
    app.add_middleware(Tag)
    with TestClient(app) as client:
        auth = {"Authorization": f"Bearer {tenants.key_a}"}
        ok = client.post(CHAT, json=GOOD, headers=auth)
        refused = client.post(CHAT, json=GOOD)
        wrong_method = client.get(CHAT, headers=auth)
    assert ok.status_code == 200 and ok.headers["x-tag"] == "1"
    assert refused.status_code == 401 and refused.headers["x-tag"] == "1"
    assert wrong_method.status_code == 405 and wrong_method.json()["error"]["code"] == (
        "method_not_allowed")
    assert seen.count(CHAT) == 3


def test_direct_routes_while_the_app_has_no_middleware_or_root_path(
    settings: Settings, db: sessionmaker[Session], tenants: Tenants
) -> None:
    """``kvtoll serve``'s server hands a POST to a completion path straight to its route
    (kvtoll.direct_http) only while nothing else must see it first."""
    app = build_app(settings, db, upstreams=[ScriptedUpstream(num_words=3)])
    assert isinstance(app, GatewayApp)
    for path in (CHAT, "/v1/completions"):
        assert isinstance(app.direct_route(b"POST", path.encode()), CompletionRoute)
    assert app.direct_route(b"GET", CHAT.encode()) is None
    assert app.direct_route(b"POST", b"/v1/models") is None
    app.root_path = "/gateway"
    assert app.direct_route(b"POST", CHAT.encode()) is None
    app.root_path = ""
    app.add_middleware(GZipMiddleware)
    assert app.direct_route(b"POST", CHAT.encode()) is None
