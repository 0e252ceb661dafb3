"""The worker's token check (engine.serving.auth) over a fake engine: every route
refuses a missing, wrong or stale token with a bare 401 and one WARNING line, before
anything reaches the engine; the current and the previous token are accepted."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import httpx
import pytest

from engine.serving.app import WorkerConfig, build_worker_app
from kvtoll.worker_auth import WorkerTokens
from tests.engine.serving.serving_fakes import FakeEngine

pytestmark = pytest.mark.anyio
CURRENT = "worker-token-current-0123456789"
PREVIOUS = "worker-token-previous-012345678"
STALE = "worker-token-stale-0123456789ab"  # rotated out before PREVIOUS
CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2, "cache_salt": "00" * 16}
ROUTES = [("POST", "/v1/chat/completions"), ("POST", "/v1/completions"),
          ("GET", "/v1/models"), ("GET", "/healthz"), ("GET", "/load"), ("GET", "/kv/events"),
          ("PUT", "/kv/shares"), ("GET", "/no-such-route")]


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
async def client(engine: FakeEngine) -> AsyncIterator[httpx.AsyncClient]:
    app = build_worker_app(engine, WorkerConfig(tokens=WorkerTokens(CURRENT, PREVIOUS)))
    transport = httpx.ASGITransport(app=app, client=("10.0.0.66", 4242))
    async with httpx.AsyncClient(transport=transport, base_url="http://worker") as c:
        yield c


def _auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.mark.parametrize("headers", [{}, _auth(STALE), _auth(CURRENT[:-1]), _auth(""),
                                     {"Authorization": f"Basic {CURRENT}"},
                                     {b"authorization": "Bearer é".encode("latin-1")}],
                         ids=["missing", "stale", "wrong", "empty", "other-scheme", "non-ascii"])
async def test_every_route_refuses_without_an_accepted_token(
    client: httpx.AsyncClient, engine: FakeEngine, headers: dict[str, str] | dict[bytes, bytes],
    caplog: pytest.LogCaptureFixture,
) -> None:
    for method, path in ROUTES:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="engine.serving.auth"):
            response = await client.request(method, path, json=CHAT, headers=headers)
        assert response.status_code == 401, (method, path)
        assert response.json() == {"error": {"message": "unauthorized", "param": None,
                                             "type": "invalid_request_error",
                                             "code": "invalid_worker_token"}}
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 1 and caplog.records[0].levelname == "WARNING"
        assert path in lines[0] and "10.0.0.66" in lines[0]
        assert CURRENT not in lines[0] and STALE not in lines[0]
    assert engine.requests == []  # nothing reached the engine: no salt was read


async def test_the_current_and_the_previous_token_are_accepted(
    client: httpx.AsyncClient, engine: FakeEngine
) -> None:
    for token in (CURRENT, PREVIOUS):
        response = await client.post("/v1/chat/completions", json=CHAT, headers=_auth(token))
        assert response.status_code == 200, response.text
        assert (await client.get("/load", headers=_auth(token))).status_code == 200
    assert [r.salt.hex() for r in engine.requests] == ["00" * 16] * 2  # type: ignore[union-attr]


async def test_without_tokens_every_caller_is_served(engine: FakeEngine) -> None:
    """Dev mode's empty token: the worker is open (``kvtoll worker`` refuses this
    outside dev mode)."""
    transport = httpx.ASGITransport(app=build_worker_app(engine, WorkerConfig()))
    async with httpx.AsyncClient(transport=transport, base_url="http://worker") as client:
        assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200


def test_a_previous_token_needs_a_current_one() -> None:
    with pytest.raises(ValueError, match="current"):
        WorkerTokens("", PREVIOUS)
