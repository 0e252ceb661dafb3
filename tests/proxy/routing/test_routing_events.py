"""KV events into the router: from a real tiny-engine worker over HTTP, and over the
real Redis streams; restarts and gaps reset a worker's entries."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from engine.api import KVEvent, KVEventKind
from engine.config import EngineConfig
from engine.factory import build_engine
from engine.kv.hashing import BlockHash, TenantSalt
from engine.serving.app import build_worker_app
from engine.serving.kv_publish import RedisEventPublisher, pump_engine_events
from kvtoll.server import serve_in_background
from proxy.routing.events import EventFeeds, HttpEventFeed, RedisEventConsumer
from proxy.routing.index import PreciseIndex
from proxy.routing.policy import make_policy
from proxy.routing.registry import RegistryConfig, WorkerRegistry
from proxy.routing.router import PrefixRouter
from proxy.routing.types import WorkerId

SALT = TenantSalt(bytes(range(16)))


def h(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(16, "big"))


async def _complete(base: str, prompt: list[int]) -> dict[str, Any]:
    body = {"model": "kvtoll-tiny", "prompt": prompt, "max_tokens": 1, "cache_salt": SALT.hex()}
    async with httpx.AsyncClient(timeout=30) as client:
        response = await client.post(f"{base}/v1/completions", json=body)
    response.raise_for_status()
    return dict(response.json())


def test_router_predicts_what_a_real_worker_then_reports_as_cached() -> None:
    engine = build_engine(EngineConfig.tiny())
    prompt = [(7 * i) % 200 + 1 for i in range(100)]

    async def scenario() -> None:
        async with serve_in_background(build_worker_app(engine)) as base:
            await _complete(base, prompt)
            async with httpx.AsyncClient(timeout=5) as http:
                registry = WorkerRegistry(RegistryConfig(), [("w0", base)], http=http)
                router = PrefixRouter(make_policy("cache_aware"), registry, engine.block_size)
                await registry.refresh()
                info = registry.get(WorkerId("w0"))
                assert info is not None and info.healthy and info.kv_events == "http"
                assert info.load.num_total_blocks == 64
                await EventFeeds(registry, router.precise, http).poll_once()
                follow_up = [*prompt, 9, 9, 9]
                plan = router.plan(follow_up, SALT)
                assert plan.choices[0].predicted_cached_tokens == 96  # 6 blocks of 16
                assert (
                    router.plan(follow_up, TenantSalt(b"x" * 16)).choices[0].predicted_cached_tokens
                    == 0
                )
                router.dispatched("r2", plan, WorkerId("w0"))
                usage = (await _complete(base, follow_up))["usage"]
                router.completed("r2", usage["prompt_tokens_details"]["cached_tokens"])
                snap = router.calibration.snapshot()
                assert (snap.num_requests, snap.num_exact) == (1, 1)

    try:
        asyncio.run(scenario())
    finally:
        engine.shutdown()


def _events_app(pages: list[dict[str, Any]]) -> httpx.MockTransport:
    """Another part (the worker) scripted: each call answers the next page."""

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=pages.pop(0))

    return httpx.MockTransport(handler)


def _page(
    instance: str, events: list[tuple[int, str, list[int]]], next_cursor: int
) -> dict[str, Any]:
    return {
        "instance_id": instance,
        "events": [
            {"seq": s, "kind": k, "block_hashes": [h(i).hex() for i in ids]} for s, k, ids in events
        ],
        "next_cursor": next_cursor,
    }


def test_http_feed_resets_on_a_new_instance_and_on_a_gap() -> None:
    index = PreciseIndex()
    w = WorkerId("w")
    pages = [
        _page("one", [(0, "stored", [1, 2]), (1, "stored", [3])], 2),
        _page("two", [(0, "stored", [8])], 1),  # restarted: new instance id
        _page("two", [(0, "stored", [8])], 1),  # re-read from cursor 0 after the reset
        _page("two", [(5, "stored", [9])], 6),  # seq 1..4 were trimmed away: a gap
    ]

    async def scenario() -> None:
        async with httpx.AsyncClient(transport=_events_app(pages)) as http:
            feed = HttpEventFeed(w, "http://worker", index, http)
            await feed.poll_once()
            assert index.match([h(1), h(2), h(3)], [w])[w] == 3
            await feed.poll_once()  # new instance: reset, then re-read from cursor 0
            assert index.match([h(1)], [w])[w] == 0 and index.match([h(8)], [w])[w] == 1
            await feed.poll_once()
            assert index.match([h(8)], [w])[w] == 0 and index.match([h(9)], [w])[w] == 1
            assert index.next_seq(w) == 6

    asyncio.run(scenario())


@pytest.mark.redis
def test_redis_stream_events_reach_the_index_and_a_restart_resets(
    redis_url: str, redis_prefix: str
) -> None:
    w = WorkerId("worker-a")

    async def scenario() -> None:
        redis = Redis.from_url(redis_url)
        try:
            index = PreciseIndex()
            consumer = RedisEventConsumer(redis, index, prefix=redis_prefix)
            first = RedisEventPublisher(redis, w, "inst-1", prefix=redis_prefix)
            await first.publish(
                [
                    KVEvent(0, KVEventKind.STORED, (h(1), h(2), h(3))),
                    KVEvent(1, KVEventKind.REMOVED, (h(3),)),
                ]
            )
            assert await consumer.poll_once([w]) == 2
            assert index.match([h(1), h(2), h(3)], [w])[w] == 2
            assert await consumer.poll_once([w]) == 0  # nothing new
            restarted = RedisEventPublisher(redis, w, "inst-2", prefix=redis_prefix)
            await restarted.publish([KVEvent(0, KVEventKind.STORED, (h(7),))])
            assert await consumer.poll_once([w], block_ms=100) == 1
            assert index.match([h(1)], [w])[w] == 0
            assert index.match([h(7)], [w])[w] == 1
        finally:
            await redis.aclose()

    asyncio.run(scenario())


@pytest.mark.redis
def test_pump_publishes_an_engine_event_log(redis_url: str, redis_prefix: str) -> None:
    log = [KVEvent(i, KVEventKind.STORED, (h(i),)) for i in range(5)]
    w = WorkerId("worker-b")

    async def scenario() -> None:
        redis = Redis.from_url(redis_url)
        try:
            stop = asyncio.Event()
            publisher = RedisEventPublisher(redis, w, "inst", prefix=redis_prefix)
            task = asyncio.create_task(
                pump_engine_events(
                    lambda cursor, limit: log[cursor : cursor + limit], publisher, stop
                )
            )
            index = PreciseIndex()
            consumer = RedisEventConsumer(redis, index, prefix=redis_prefix)
            while index.next_seq(w) < 5:
                await consumer.poll_once([w], block_ms=200)
            stop.set()
            await task
            assert index.match([h(0)], [w])[w] == 1 and index.num_blocks(w) == 5
        finally:
            await redis.aclose()

    asyncio.run(scenario())
