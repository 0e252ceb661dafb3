"""HttpUpstream.push_kv_shares against real servers on free ports: a kvtoll worker with
the tiny engine takes the table (the share shows on its ``/load``), a worker behind a
unreachable worker is a failed push (retried at the next tick), and an OpenAI-compatible
server without the route is not a kvtoll worker (None: never asked again)."""

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
from kvtoll.server import serve_in_background
from proxy.upstream.http import HttpUpstream, HttpUpstreamConfig
from tests.proxy.upstream.upstream_helpers import Script, scripted_server

pytestmark = pytest.mark.anyio
SHARE = {"cache_salt": "0a" * 16, "tenant": "acme", "reserved_blocks": 8, "max_blocks": 16}


@pytest.fixture
async def engine() -> AsyncIterator[AsyncEngine]:
    eng = build_engine(EngineConfig.tiny(num_kv_blocks=32))
    yield eng
    eng.shutdown()


async def _tenants(url: str) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=url) as client:
        for _ in range(1000):  # the step thread applies a push before its next step
            tenants = {t["tenant"]: t for t in (await client.get("/load")).json()["tenants"]}
            if tenants:
                return tenants
            await asyncio.sleep(0.01)
    raise AssertionError("the pushed share never applied")


async def test_a_kvtoll_worker_takes_the_pushed_table(engine: AsyncEngine) -> None:
    async with serve_in_background(build_worker_app(engine)) as url:
        up = HttpUpstream(HttpUpstreamConfig(url))
        try:
            assert await up.push_kv_shares([SHARE]) is True
        finally:
            await up.aclose()
        tenants = await _tenants(url)
    assert tenants["acme"]["reserved_blocks"] == 8 and tenants["acme"]["max_blocks"] == 16


async def test_a_server_without_the_route_takes_no_shares() -> None:
    async with serve_in_background(scripted_server(Script())) as url:
        up = HttpUpstream(HttpUpstreamConfig(url))
        try:
            assert await up.push_kv_shares([SHARE]) is None
        finally:
            await up.aclose()


async def test_an_unreachable_worker_is_a_failed_push() -> None:
    async with serve_in_background(scripted_server(Script())) as url:
        pass  # the port is free again: nothing listens there
    up = HttpUpstream(HttpUpstreamConfig(url))
    try:
        assert await up.push_kv_shares([SHARE]) is False
    finally:
        await up.aclose()
