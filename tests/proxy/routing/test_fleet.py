"""Workers that announce themselves in the real Redis (signed with the worker token)
become the gateway's upstreams, called with the token (and leave when their
announcement goes); the router's calibration and per-worker state appear on the
gateway's ``/metrics``."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import httpx
import pytest
from redis.asyncio import Redis
from sqlalchemy.orm import Session, sessionmaker

from billing.db import make_engine, session_factory
from billing.migrate import upgrade
from engine.api.wire import announcement_key
from engine.async_engine import AsyncEngine
from engine.config import TINY_MODEL, EngineConfig
from engine.factory import build_engine
from engine.serving.app import WorkerConfig, build_worker_app
from engine.serving.kv_publish import announce
from kvtoll.server import serve_in_background
from kvtoll.settings import load_settings
from kvtoll.worker_auth import WorkerTokens
from proxy.app import create_app
from proxy.routing.hook import RoutingOptions, RoutingStack
from proxy.routing.registry import RegistryConfig
from proxy.upstream.link import WorkerLink
from tests.proxy.helpers import ADMIN_TOKEN, Tenants, seed
from tests.proxy.scripted import ScriptedUpstream

pytestmark = [pytest.mark.anyio, pytest.mark.redis]
WORKER_TOKEN = "fleet-test-worker-token-0123456"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def worker_url() -> AsyncIterator[str]:
    engine: AsyncEngine = build_engine(EngineConfig.tiny())
    try:
        config = WorkerConfig(tokens=WorkerTokens(WORKER_TOKEN))
        async with serve_in_background(build_worker_app(engine, config)) as url:
            yield url
    finally:
        engine.shutdown()


@pytest.fixture
def factory(sqlite_url: str) -> sessionmaker[Session]:
    upgrade(sqlite_url)
    return session_factory(make_engine(sqlite_url))


async def _until(check: Callable[[], bool], what: str) -> None:
    for _ in range(300):
        if check():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


async def test_announced_workers_join_and_leave_the_pool(
    worker_url: str, factory: sessionmaker[Session], redis_url: str, redis_prefix: str,
    tmp_path: Path,
) -> None:
    tenants: Tenants = seed(factory, model=TINY_MODEL)
    settings = load_settings(database_url="sqlite://", admin_token=ADMIN_TOKEN,
                             secret="fleet-secret", data_dir=str(tmp_path), redis_url=None)
    redis = Redis.from_url(redis_url)
    options = RoutingOptions(
        policy="round_robin",
        registry=RegistryConfig(redis_prefix=redis_prefix, check_interval_s=0.1),
        link=WorkerLink(WORKER_TOKEN),
    )
    routing = RoutingStack(options, [], redis=redis)
    local = ScriptedUpstream("local-0")
    app = create_app(settings, upstreams=[local], session_factory=factory, models=[TINY_MODEL],
                     router=routing.hook, fleet=routing.fleet, resources=[routing])
    pool = app.state.kvtoll.pool
    names: Callable[[], set[str]] = lambda: {u.name for u in pool.upstreams}  # noqa: E731
    headers = {"Authorization": f"Bearer {tenants.key_a}"}
    body = {"model": TINY_MODEL, "prompt": "a fleet of workers", "max_tokens": 2}
    transport = httpx.ASGITransport(app=app)
    try:
        async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=transport, base_url="http://gateway", timeout=60
        ) as client:
            assert names() == {"local-0"}
            await announce(redis, worker_url, 30, prefix=redis_prefix, kv_events="http",
                           tokens=[WORKER_TOKEN])
            await _until(lambda: names() == {"local-0", worker_url}, "the worker to join")
            served = []
            for _ in range(4):
                response = await client.post("/v1/completions", json=body, headers=headers)
                assert response.status_code == 200, response.text
                served.append(response.headers["x-kvtoll-worker"])
            assert set(served) == {"local-0", worker_url}  # round robin over both
            admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
            metrics = (await client.get("/metrics", headers=admin)).text
            assert f'kvtoll_router_worker_healthy{{worker="{worker_url}"}} 1.0' in metrics
            assert "kvtoll_router_prediction_error_tokens_count" in metrics
            await redis.delete(announcement_key(redis_prefix, worker_url))
            await _until(lambda: names() == {"local-0"}, "the worker to leave")
            for _ in range(2):
                response = await client.post("/v1/completions", json=body, headers=headers)
                assert response.headers["x-kvtoll-worker"] == "local-0"
            assert worker_url not in (await client.get("/metrics", headers=admin)).text
    finally:
        await redis.aclose()
