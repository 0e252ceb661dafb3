"""``PUT /kv/shares`` with the real tiny engine: a pushed share holds before the
tenant's first request; shares the pool cannot hold are refused one by one; a
malformed table is a 400 and changes nothing; an engine without the hook is a 501."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.factory import build_engine
from engine.serving.app import build_worker_app
from tests.engine.serving.serving_fakes import FakeEngine

pytestmark = pytest.mark.anyio
SALT_A, SALT_B = "0a" * 16, "0b" * 16


@pytest.fixture
async def engine() -> AsyncIterator[AsyncEngine]:
    eng = build_engine(EngineConfig.tiny(num_kv_blocks=32))
    yield eng
    eng.shutdown()


@pytest.fixture
async def client(engine: AsyncEngine) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=build_worker_app(engine))
    async with httpx.AsyncClient(transport=transport, base_url="http://worker") as c:
        yield c


def _entry(salt: str, tenant: str, reserved: int, cap: int | None = None) -> dict[str, Any]:
    return {"cache_salt": salt, "tenant": tenant, "reserved_blocks": reserved, "max_blocks": cap}


async def _tenants(client: httpx.AsyncClient, want: int) -> dict[str, Any]:
    """The /load tenants once ``want`` of them are listed (the step thread applies a
    push before its next step; 10 s only guards against a hang)."""
    for _ in range(1000):
        tenants = {t["tenant"]: t for t in (await client.get("/load")).json()["tenants"]}
        if len(tenants) >= want:
            return tenants
        await asyncio.sleep(0.01)
    raise AssertionError(f"pushed shares never applied: {tenants}")


async def test_a_pushed_share_holds_before_the_tenants_first_request(
    client: httpx.AsyncClient,
) -> None:
    resp = await client.put("/kv/shares", json={"shares": [
        _entry(SALT_A, "acme", 8, 16), _entry(SALT_B, "bolt", 40)]})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["applied"] == 1 and len(body["refused"]) == 1
    assert "'bolt'" in body["refused"][0]
    assert "exceeds this worker's pool of 32" in body["refused"][0]
    tenants = await _tenants(client, 1)
    assert set(tenants) == {"acme"}
    assert tenants["acme"]["reserved_blocks"] == 8 and tenants["acme"]["max_blocks"] == 16
    shares = [_entry(SALT_A, "acme", 0), _entry(SALT_B, "bolt", 4)]
    await client.put("/kv/shares", json={"shares": shares})
    tenants = await _tenants(client, 2)
    assert tenants["acme"]["reserved_blocks"] == 0 and tenants["acme"]["max_blocks"] is None
    assert tenants["bolt"]["reserved_blocks"] == 4


@pytest.mark.parametrize("body", [
    {"shares": [_entry("0a" * 16, "acme", -1)]},
    {"shares": [_entry("xyz", "acme", 1)]},
    {"shares": [_entry("0a0", "acme", 1)]},
    {"shares": [{**_entry("0a" * 16, "acme", 1), "extra": 1}]},
    {"shares": [_entry("0a" * 16, "acme", True)]},  # type: ignore[arg-type]
    {"shares": "all"},
    {},
], ids=["negative", "not-hex", "odd-hex", "extra-field", "bool", "not-a-list", "empty"])
async def test_a_malformed_table_is_a_400_and_applies_nothing(
    client: httpx.AsyncClient, engine: AsyncEngine, body: dict[str, Any]
) -> None:
    resp = await client.put("/kv/shares", json=body)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["message"].startswith("invalid kv shares")
    assert engine.load().tenants == ()


async def test_an_engine_without_pushed_shares_answers_501() -> None:
    transport = httpx.ASGITransport(app=build_worker_app(FakeEngine()))
    async with httpx.AsyncClient(transport=transport, base_url="http://worker") as c:
        resp = await c.put("/kv/shares", json={"shares": []})
    assert resp.status_code == 501
