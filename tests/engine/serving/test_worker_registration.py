"""A worker announces itself and publishes its KV events in the real Redis, in the
format the router reads (proxy.routing), and withdraws on stop."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from redis.asyncio import Redis

from engine.api import GenerationRequest, SamplingParams
from engine.api.wire import announcement_key, parse_announcement, stream_key
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.factory import build_engine
from engine.serving.registration import Registration, run_registration

pytestmark = [pytest.mark.anyio, pytest.mark.redis]
URL = "http://10.1.2.3:8001"
TOKENS = ("registration-test-token-current", "registration-test-token-previous")


@pytest.fixture
async def engine() -> AsyncIterator[AsyncEngine]:
    eng = build_engine(EngineConfig.tiny())
    yield eng
    eng.shutdown()


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


async def _until(check: object, tries: int = 500) -> None:
    for _ in range(tries):
        if await check():  # type: ignore[operator]
            return
        await asyncio.sleep(0.01)


async def test_announce_publish_withdraw(
    engine: AsyncEngine, redis_url: str, redis_prefix: str
) -> None:
    redis = Redis.from_url(redis_url)
    reg = Registration(redis_url, URL + "/", ttl_s=5, prefix=redis_prefix, tokens=TOKENS)
    stop = asyncio.Event()
    task = asyncio.create_task(run_registration(reg, engine, "inst-1", stop))
    key = announcement_key(redis_prefix, URL)
    stream = stream_key(redis_prefix, URL)
    try:
        await _until(lambda: redis.exists(key))
        raw = await redis.get(key)
        assert raw is not None
        body = json.loads(raw)
        assert {k: body[k] for k in ("name", "url", "kv_events", "instance_id")} == {
            "name": URL, "url": URL, "kv_events": "redis", "instance_id": "inst-1"}
        now = time.time()
        assert now < body["expires_at"] <= now + 5
        for token in TOKENS:  # signed for gateways on either token (rotation)
            announced = parse_announcement(raw, URL, token, now)
            assert announced is not None and announced.url == URL
        assert parse_announcement(raw, URL, "another-token-entirely-0123", now) is None
        assert parse_announcement(raw, "other-name", TOKENS[0], now) is None
        assert parse_announcement(raw, URL, TOKENS[0], body["expires_at"]) is None
        assert 0 < await redis.pttl(key) <= 5000
        request = GenerationRequest("g1", tuple(range(1, 41)), SamplingParams(max_tokens=1))
        async for _ in engine.generate(request):
            pass

        async def published() -> bool:
            return bool(await redis.xlen(stream))

        await _until(published)
        entries: Any = await redis.xrange(stream)
        fields = [{_text(k): _text(v) for k, v in e[1].items()} for e in entries]
        expected = engine.kv_events(0)
        assert [int(f["seq"]) for f in fields] == [e.seq for e in expected]
        assert fields[0]["instance"] == "inst-1" and fields[0]["kind"] == "stored"
        assert fields[0]["hashes"].split(",") == [h.hex() for h in expected[0].block_hashes]
    finally:
        stop.set()
        await task
    assert not await redis.exists(key)
    await redis.aclose()


async def test_redis_down_keeps_retrying_without_raising(engine: AsyncEngine) -> None:
    reg = Registration("redis://127.0.0.1:9/0", URL, ttl_s=5, retry_s=0.05)
    stop = asyncio.Event()
    task = asyncio.create_task(run_registration(reg, engine, "inst-2", stop))
    await asyncio.sleep(0.3)
    assert not task.done()
    stop.set()
    await task
