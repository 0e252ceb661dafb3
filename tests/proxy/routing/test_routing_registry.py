"""Worker registry: Redis heartbeats (real Redis), health checks, dead workers leaving."""

from __future__ import annotations

import asyncio
import socket

import httpx
import pytest
from redis.asyncio import Redis

from engine.api.wire import announcement_body, announcement_key
from engine.serving.kv_publish import Heartbeat, announce
from proxy.routing.registry import RegistryConfig, WorkerRegistry
from proxy.routing.types import WorkerId

TOKEN = "registry-test-worker-token-0123"


def _closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def _worker_transport(load_status: int = 200) -> httpx.MockTransport:
    """Another part (a worker) scripted: /load, or only /health like vLLM."""

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/load" and load_status == 200:
            body = {
                "num_running": 2,
                "num_waiting": 1,
                "num_free_blocks": 10,
                "num_total_blocks": 40,
                "block_size": 16,
                "instance_id": "i1",
            }
            return httpx.Response(200, json=body)
        if request.url.path == "/health":
            return httpx.Response(200)
        return httpx.Response(404)

    return httpx.MockTransport(handler)


@pytest.mark.redis
def test_heartbeat_expiry_removes_a_worker(redis_url: str, redis_prefix: str) -> None:
    async def scenario() -> None:
        redis = Redis.from_url(redis_url)
        try:
            config = RegistryConfig(redis_prefix=redis_prefix)
            async with httpx.AsyncClient(transport=_worker_transport()) as http:
                registry = WorkerRegistry(config, redis=redis, http=http,
                                          registration_token=TOKEN)
                await announce(redis, "http://w1:8001", 0.3, prefix=redis_prefix, name="w1",
                               tokens=[TOKEN])
                await announce(redis, "http://w2:8001", 30, prefix=redis_prefix, name="w2",
                               kv_events="redis", tokens=[TOKEN])
                await registry.refresh()
                assert {w.worker_id for w in registry.workers()} == {"w1", "w2"}
                assert registry.get(WorkerId("w2")).kv_events == "redis"  # type: ignore[union-attr]
                assert {s.worker_id for s in registry.healthy_workers()} == {"w1", "w2"}
                await asyncio.sleep(0.5)  # w1 stopped announcing: its key expires
                await registry.refresh()
                assert [w.worker_id for w in registry.workers()] == ["w2"]
        finally:
            await redis.aclose()

    asyncio.run(scenario())


@pytest.mark.redis
def test_a_heartbeat_keeps_a_worker_announced_and_withdraws_it_on_stop(
    redis_url: str, redis_prefix: str
) -> None:
    async def scenario() -> None:
        redis = Redis.from_url(redis_url)
        try:
            stop = asyncio.Event()
            # Renewed every TTL / 3 = 0.5 s: only a 1.5 s stall of this loop would let the
            # key lapse (at a 0.3 s TTL a loaded 2-core CI machine once stalled that long).
            beat = Heartbeat(redis, "http://w3:8001", 1.5, prefix=redis_prefix, name="w3",
                             tokens=[TOKEN])
            task = asyncio.create_task(beat.run(stop))
            await asyncio.sleep(3.2)  # more than two TTLs
            registry = WorkerRegistry(RegistryConfig(redis_prefix=redis_prefix), redis=redis,
                                      registration_token=TOKEN)
            await registry.discover()
            assert [w.worker_id for w in registry.workers()] == ["w3"]
            stop.set()
            await task
            await registry.discover()
            assert registry.workers() == []
            await registry.aclose()
        finally:
            await redis.aclose()

    asyncio.run(scenario())


def test_load_is_polled_and_a_dead_static_worker_leaves_the_candidates() -> None:
    dead = _closed_port_url()

    async def scenario() -> None:
        config = RegistryConfig(failures_to_evict=2, check_timeout_s=0.5)
        async with httpx.AsyncClient(transport=_worker_transport()) as mocked:
            alive = WorkerRegistry(config, [("ok", "http://ok:8001")], http=mocked)
            await alive.refresh()
            status = alive.healthy_workers()[0]
            assert status.load.num_running == 2 and status.load.num_total_blocks == 40
            assert status.kv_events
        registry = WorkerRegistry(config, [("dead", dead)])
        await registry.refresh()
        assert [s.worker_id for s in registry.healthy_workers()] == ["dead"]  # one miss
        await registry.refresh()
        assert registry.healthy_workers() == []
        await registry.aclose()

    asyncio.run(scenario())


def test_a_server_without_load_is_healthy_in_approximate_mode_and_failures_evict() -> None:
    async def scenario() -> None:
        async with httpx.AsyncClient(transport=_worker_transport(load_status=404)) as http:
            registry = WorkerRegistry(RegistryConfig(), [("vllm", "http://vllm:8000")], http=http)
            await registry.refresh()
            [status] = registry.healthy_workers()
            assert not status.kv_events and status.load.num_requests == 0
            registry.report_failure(WorkerId("vllm"))
            assert registry.healthy_workers() == []
            await registry.refresh()  # a passing check brings it back, as a new incarnation
            info = registry.get(WorkerId("vllm"))
            assert info is not None and info.healthy and info.incarnation == 1

    asyncio.run(scenario())


@pytest.mark.redis
def test_a_worker_found_through_redis_streams_its_events_to_the_router(
    redis_url: str, redis_prefix: str
) -> None:
    from engine.api import KVEvent, KVEventKind
    from engine.kv.hashing import BlockHash
    from engine.serving.kv_publish import run_worker_presence
    from proxy.routing.events import EventFeeds, RedisEventConsumer
    from proxy.routing.index import PreciseIndex

    log = [KVEvent(i, KVEventKind.STORED, (BlockHash(bytes([i]) * 16),)) for i in range(3)]

    async def scenario() -> None:
        redis = Redis.from_url(redis_url)
        try:
            stop = asyncio.Event()
            worker = asyncio.create_task(
                run_worker_presence(
                    redis,
                    "http://w9:8001",
                    lambda c, n: log[c : c + n],
                    "inst-9",
                    stop,
                    ttl_s=2.0,
                    prefix=redis_prefix,
                    name="w9",
                    tokens=[TOKEN],
                )
            )
            async with httpx.AsyncClient(transport=_worker_transport()) as http:
                config = RegistryConfig(redis_prefix=redis_prefix)
                registry = WorkerRegistry(config, redis=redis, http=http,
                                          registration_token=TOKEN)
                index = PreciseIndex()
                consumer = RedisEventConsumer(redis, index, prefix=redis_prefix)
                feeds = EventFeeds(registry, index, http, consumer)
                while index.num_blocks(WorkerId("w9")) < 3:
                    await registry.refresh()
                    await feeds.poll_once(block_ms=100)
                assert registry.get(WorkerId("w9")).kv_events == "redis"  # type: ignore[union-attr]
                stop.set()
                await worker
                await registry.refresh()  # withdrawn on stop: gone, and so is its index
                await feeds.poll_once()
                assert registry.workers() == [] and index.num_blocks(WorkerId("w9")) == 0
        finally:
            await redis.aclose()

    asyncio.run(scenario())


def test_a_malformed_load_answer_counts_as_a_failed_check() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"num_running": None, "num_waiting": "x"})

    async def scenario() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
            config = RegistryConfig(failures_to_evict=1)
            registry = WorkerRegistry(config, [("odd", "http://odd:8001")], http=http)
            await registry.refresh()
            assert registry.healthy_workers() == []

    asyncio.run(scenario())


def test_discovery_needs_the_worker_token() -> None:
    redis = Redis.from_url("redis://127.0.0.1:1")  # never connected
    with pytest.raises(ValueError, match="worker token"):
        WorkerRegistry(RegistryConfig(), redis=redis)


def _forged_records(now: float) -> dict[str, str]:
    """Records a Redis writer without the worker token can make, by name."""
    signed_for_w = announcement_body("w", "http://10.9.9.9:1", "http", None, now + 30, [TOKEN])
    return {
        "plain": '{"url": "http://10.9.9.9:1", "kv_events": "http"}',  # the old format
        "wrong-token": announcement_body("wrong-token", "http://10.9.9.9:1", "http", None,
                                         now + 30, ["not-the-worker-token-0123456789"]),
        "expired": announcement_body("expired", "http://10.9.9.9:1", "http", None, now - 1,
                                     [TOKEN]),
        "forever": announcement_body("forever", "http://10.9.9.9:1", "http", None, now + 10**6,
                                     [TOKEN]),
        "copied": signed_for_w,  # a genuine record replayed under another name
        "tampered": signed_for_w.replace("10.9.9.9:1", "10.6.6.6:1").replace('"w"', '"tampered"'),
        "garbage": "not json",
    }


@pytest.mark.redis
def test_unsigned_forged_expired_or_copied_registrations_are_ignored(
    redis_url: str, redis_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Anyone who can write Redis can write these keys; none may add a worker."""
    import time

    probed: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        probed.append(str(request.url))
        return _worker_transport().handle_request(request)

    async def scenario() -> None:
        redis = Redis.from_url(redis_url)
        try:
            for name, body in _forged_records(time.time()).items():
                await redis.set(announcement_key(redis_prefix, name), body, ex=60)
            await announce(redis, "http://good:8001", 30, prefix=redis_prefix, name="good",
                           tokens=[TOKEN])
            async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
                registry = WorkerRegistry(RegistryConfig(redis_prefix=redis_prefix),
                                          redis=redis, http=http, registration_token=TOKEN)
                with caplog.at_level("WARNING", logger="proxy.routing.registry"):
                    await registry.refresh()
                    await registry.refresh()  # the same forged records again: no new lines
                assert [w.worker_id for w in registry.workers()] == ["good"]
                assert probed and all(url.startswith("http://good:8001/") for url in probed)
        finally:
            await redis.aclose()

    asyncio.run(scenario())
    refused = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(refused) == len(_forged_records(0))


@pytest.mark.redis
def test_an_announced_worker_gets_traffic_only_after_an_authenticated_probe(
    redis_url: str, redis_prefix: str
) -> None:
    """A validly signed record is not enough: until the worker answers a probe sent
    with the token it is no candidate (here it refuses the token: 401)."""
    refusing = httpx.MockTransport(lambda request: httpx.Response(401))

    async def scenario() -> None:
        redis = Redis.from_url(redis_url)
        try:
            await announce(redis, "http://w5:8001", 30, prefix=redis_prefix, name="w5",
                           tokens=[TOKEN])
            async with httpx.AsyncClient(transport=refusing) as http:
                registry = WorkerRegistry(RegistryConfig(redis_prefix=redis_prefix),
                                          redis=redis, http=http, registration_token=TOKEN)
                await registry.discover()
                assert [w.worker_id for w in registry.workers()] == ["w5"]
                assert registry.healthy_workers() == []
                await registry.refresh()
                assert registry.healthy_workers() == []
        finally:
            await redis.aclose()

    asyncio.run(scenario())


def _dtype_transport(dtypes: dict[str, str]) -> httpx.MockTransport:
    """Workers scripted by host: /load, and /v1/models naming each one's dtype."""

    def handler(request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if request.url.path == "/load":
            return httpx.Response(200, json={"num_total_blocks": 40, "block_size": 16,
                                             "instance_id": f"i-{host}"})
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [
                {"id": "smollm2", "object": "model", "kvtoll": {"dtype": dtypes[host]}}]})
        return httpx.Response(404)

    return httpx.MockTransport(handler)


@pytest.mark.redis
def test_discovered_workers_of_one_model_in_another_dtype_are_kept_out(
    redis_url: str, redis_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker found through discovery is dtype-checked like a listed one: one that
    serves the model in another dtype than the pool never becomes a candidate, and the
    error names both workers (once, not every round)."""

    async def scenario() -> None:
        redis = Redis.from_url(redis_url)
        try:
            config = RegistryConfig(redis_prefix=redis_prefix)
            transport = _dtype_transport({"w1": "bfloat16", "w2": "bfloat16", "w3": "float32"})
            async with httpx.AsyncClient(transport=transport) as http:
                registry = WorkerRegistry(config, [("w1", "http://w1:8001")], redis=redis,
                                          http=http, registration_token=TOKEN)
                await registry.refresh()
                for name in ("w2", "w3"):
                    await announce(redis, f"http://{name}:8001", 30, prefix=redis_prefix,
                                   name=name, tokens=[TOKEN])
                with caplog.at_level("ERROR", logger="proxy.routing.registry"):
                    for _ in range(3):
                        await registry.refresh()
                assert {s.worker_id for s in registry.healthy_workers()} == {"w1", "w2"}
                errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
                assert len(errors) == 1
                assert "w3 (http://w3:8001) serves smollm2 in float32" in errors[0]
                assert "worker w1 (http://w1:8001) serves it in bfloat16" in errors[0]
        finally:
            await redis.aclose()

    asyncio.run(scenario())
