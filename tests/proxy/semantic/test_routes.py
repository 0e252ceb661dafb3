"""Cache routes mounted on a bare FastAPI app (the proxy's auth stands in as a header)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import httpx
import pytest
from fastapi import FastAPI, Header, HTTPException

from proxy.semantic.routes import build_admin_cache_router, build_cache_router
from proxy.semantic.service import SemanticCache
from tests.proxy.semantic.semantic_helpers import answer, chat

pytestmark = pytest.mark.anyio


@dataclass(frozen=True)
class Identity:
    tenant_id: int


def tenant_from_header(x_tenant: str = Header()) -> Identity:
    return Identity(int(x_tenant))


def admin_only(x_admin: str = Header(default="")) -> None:
    if x_admin != "yes":
        raise HTTPException(status_code=401)


@pytest.fixture
async def setup(
    make_cache: Callable[..., SemanticCache],
) -> AsyncIterator[tuple[SemanticCache, httpx.AsyncClient]]:
    cache = make_cache()
    app = FastAPI()
    app.include_router(build_cache_router(cache, tenant_from_header))
    tenants = {"acme": 1, "globex": 2}
    app.include_router(build_admin_cache_router(cache, admin_only, tenants.get))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        yield cache, client


async def test_delete_is_tenant_scoped(setup: tuple[SemanticCache, httpx.AsyncClient]) -> None:
    cache, client = setup
    entry_id = await cache.store(1, chat("Who wrote Hamlet?"), answer("Shakespeare"))
    other = await client.delete(f"/v1/cache/entries/{entry_id}", headers={"x-tenant": "2"})
    assert other.status_code == 404
    assert other.json()["error"]["code"] == "cache_entry_not_found"
    assert await cache.lookup(1, chat("Who wrote Hamlet?")) is not None
    own = await client.delete(f"/v1/cache/entries/{entry_id}", headers={"x-tenant": "1"})
    assert own.status_code == 200 and own.json()["deleted"] is True
    assert await cache.lookup(1, chat("Who wrote Hamlet?")) is None


async def test_feedback_invalidates_by_request_id(
    setup: tuple[SemanticCache, httpx.AsyncClient],
) -> None:
    cache, client = setup
    entry_id = await cache.store(1, chat("Who wrote Hamlet?"), answer("Marlowe"))
    rid = "0b6f8a52-3c1e-4d7a-9f00-5e2b8c9d1a34"
    served = await cache.lookup(1, chat("Who wrote Hamlet?"), request_id=rid, max_error_rate=0.02)
    assert served is not None
    body = {"request_id": rid, "feedback": "wrong"}
    assert (
        await client.post("/v1/cache/feedback", json=body, headers={"x-tenant": "2"})
    ).status_code == 404
    resp = await client.post("/v1/cache/feedback", json=body, headers={"x-tenant": "1"})
    assert resp.status_code == 200 and resp.json()["invalidated"] == entry_id
    assert await cache.lookup(1, chat("Who wrote Hamlet?")) is None
    assert cache.stats.invalidations == 1
    assert cache.stats.tenant("1").feedback_wrong == 1
    tenant, _ = await cache._store.evidence("1", [])
    assert tenant.num_wrong == 1  # a wrong observation at the score it was served at


@pytest.mark.parametrize(
    "body",
    [
        {"feedback": "wrong"},
        {"entry_id": 5, "feedback": "wrong"},
        {"entry_id": "x", "feedback": "ok"},
        {"entry_id": "x", "feedback": "wrong"},
        {"entry_id": "sem_" + "g" * 32, "feedback": "wrong"},
        {"request_id": "r-42", "feedback": "wrong"},
        {"request_id": "", "feedback": "wrong"},
        {"request_id": "0b6f8a52-3c1e-4d7a-9f00-5e2b8c9d1a34\n", "feedback": "wrong"},
        [1],
    ],
)
async def test_bad_feedback_is_a_400_in_openai_shape(
    setup: tuple[SemanticCache, httpx.AsyncClient], body: object
) -> None:
    cache, client = setup
    entry_id = await cache.store(1, chat("Who wrote Hamlet?"), answer("Marlowe"))
    resp = await client.post("/v1/cache/feedback", json=body, headers={"x-tenant": "1"})
    assert resp.status_code == 400
    assert set(resp.json()["error"]) == {"message", "type", "param", "code"}
    assert cache.num_mirrored(1) == 1 and entry_id is not None  # nothing changed
    assert cache.stats.invalidations == 0
    assert (await cache._store.evidence("1", []))[0].num_wrong == 0


async def test_admin_flush(setup: tuple[SemanticCache, httpx.AsyncClient]) -> None:
    cache, client = setup
    await cache.store(1, chat("Who wrote Hamlet?"), answer("Shakespeare"))
    await cache.store(2, chat("Who wrote Hamlet?"), answer("Shakespeare"))
    assert (await client.delete("/admin/tenants/acme/cache")).status_code == 401
    assert (
        await client.delete("/admin/tenants/nope/cache", headers={"x-admin": "yes"})
    ).status_code == 404
    resp = await client.delete("/admin/tenants/acme/cache", headers={"x-admin": "yes"})
    assert resp.status_code == 200 and resp.json()["flushed"] == 1
    assert cache.num_mirrored(1) == 0 and cache.num_mirrored(2) == 1
